"""Errors a user can see. Each names the thing at fault."""


class AgentRTError(Exception):
    """Base class of every error agentrt raises on purpose."""


class ModelLoadError(AgentRTError):
    """A model could not be found, read or matched to our model code."""


class ModelNotInstalledError(ModelLoadError):
    """A known model whose package is not installed; the message says how to install it."""


class RequestError(AgentRTError, ValueError):
    """A generation request is invalid (empty prompt, too long, bad sampling parameters)."""


class SpecConfigError(AgentRTError, ValueError):
    """A speculation input is invalid: an acceptance rate, a draft length, a cost model, a policy."""


class CalibrationError(AgentRTError):
    """Step-cost calibration could not produce a model (too few or unusable timings, bad cache file)."""


class SpecError(AgentRTError, ValueError):
    """Invalid input to speculative decoding: verification tensors, drafter calls, statistics."""
