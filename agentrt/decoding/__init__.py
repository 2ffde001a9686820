"""How logits become tokens: temperature, top-k/top-p, per-position keyed uniforms and inverse-CDF draws
(sampling.py), penalties, logit bias and min_tokens (penalties.py). Below spec: exact verification draws
its residual and bonus tokens with the same sampler the engine samples with."""
