"""Hugging Face checkpoint files (docs/checkpoint.md): ``config.json`` + safetensors, sharded with an index when large,
and ``generation_config.json`` (the defaults of ``generate``: EOS, PAD ...).

Reading builds the model on the meta device and assigns the file tensors, so nothing is randomly initialised and a
48B checkpoint needs only its own memory. Writing goes to temporary names that are renamed into place only once
everything is on disk, so an interrupted save never destroys the previous checkpoint's files.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import config_to_dict, load_config
from .generation_config import GENERATION_CONFIG_FILE, generation_config_dict, read_generation_config

if TYPE_CHECKING:
    from .modeling import KimiLinearForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "float64": torch.float64}
# transformers' save_pretrained writes the dense FFN of the first layers under `block_sparse_moe.` (its MoE rename
# applied in reverse); the published checkpoint uses `mlp.`. Accept both.
_ALIASES = [(re.compile(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$"), r".mlp.\1.weight")]


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` / ``"auto"`` / None -> a torch dtype."""
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    else:
        raise TypeError(f"`dtype` must be a torch.dtype or a string, got {type(dtype).__name__}")
    if name not in _DTYPES:
        raise ValueError(f"`dtype` must be one of float32, bfloat16, float16, got {dtype!r}")
    return _DTYPES[name]


def auto_dtype(config: object, device: str | torch.device) -> torch.dtype:
    """What ``dtype="auto"`` / None loads as: the checkpoint's dtype, except that a 16-bit checkpoint computes in
    float32 on a CPU. CPUs have no fast bf16/fp16 matrix units in general: on 2 cores the shipped model decodes
    at ~190 tok/s in float32 against ~95-137 tok/s in bf16, and float32 keeps batched decoding equal to decoding
    one sequence at a time (bf16 rounding of different batch shapes flips greedy choices)."""
    saved = resolve_dtype(getattr(config, "dtype", None) or None)
    if torch.device(device).type == "cpu" and saved in (torch.bfloat16, torch.float16):
        return torch.float32
    return saved


def weight_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory, from the index when there is one."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no `weight_map`")
        return sorted(set(weight_map.values()))
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r}")


def _open_weights(path: str, file: str):
    """A ``safe_open`` handle on ``path/file``, or an error saying which file is missing or damaged."""
    full = os.path.join(path, file)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"{INDEX_FILE} names {file!r}, which is missing from {path!r}")
    try:
        return safe_open(full, framework="pt", device="cpu")
    except SafetensorError as e:
        # A truncated download or an interrupted copy: the header promises more bytes than the file holds.
        raise ValueError(f"{full} is truncated or corrupt ({e}); download or copy it again") from e


def _canonical(name: str) -> str:
    for pattern, repl in _ALIASES:
        name = pattern.sub(repl, name)
    return name


def load_pretrained(
    cls: type[KimiLinearForCausalLM], path: str | os.PathLike, dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu", progress: bool = False,
) -> KimiLinearForCausalLM:
    from .modeling import keeps_fp32

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    config = load_config(path)
    generation_config = read_generation_config(path)
    dtype = resolve_dtype(dtype, default=auto_dtype(config, device))
    with torch.device("meta"):
        model = cls(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    files = weight_files(path)
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    # Every file's header first (cheap: a memory map), so a damaged shard fails before any progress is shown.
    handles = [(file, _open_weights(path, file)) for file in files]
    bar = _progress(total=len(expected), desc="loading", enabled=progress)
    for file, f in handles:
        with f:
            for key in f.keys():
                name = _canonical(key)
                if name not in expected:
                    unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != expected[name]:
                    raise ValueError(f"tensor `{key}` in {file} has shape {list(shape)}, the config implies "
                                     f"{list(expected[name])}")
                want = torch.float32 if keeps_fp32(name) and dtype != torch.float64 else dtype
                loaded[name] = f.get_tensor(key).to(device=device, dtype=want)
                bar.update(1)
    bar.close()
    missing = [k for k in expected if k not in loaded]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path!r} is missing tensor(s) {', '.join(f'`{m}`' for m in missing[:5])}{more}")
    if unexpected:
        warnings.warn(f"ignoring {len(unexpected)} tensor(s) the model does not use, e.g. {unexpected[:3]}",
                      stacklevel=3)
    model.load_state_dict(loaded, strict=True, assign=True)
    if generation_config is not None:
        model.generation_config = generation_config
    # Only the model holds the loaded tensors now: optimize_layout packs the MoE experts into stacks one layer at a
    # time, and each layer's separate tensors must be freed as it goes (else a 48B model would need twice its size).
    del loaded
    return model.optimize_layout().eval()


def parse_size(size: int | str) -> int:
    """``5GB`` / ``500MB`` / ``2GiB`` / bytes -> bytes."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"`max_shard_size` must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"`max_shard_size` must look like '5GB' or '500MB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base**power)


def _write_atomic_json(obj: dict, final: str) -> str:
    tmp = _tmp_name(final)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _tmp_name(final: str) -> str:
    d, base = os.path.split(final)
    return os.path.join(d, f".{base}.tmp-{os.getpid()}")


def save_pretrained(
    model: KimiLinearForCausalLM, path: str | os.PathLike, max_shard_size: int | str = "5GB", progress: bool = False
) -> None:
    path = os.fspath(path)
    limit = parse_size(max_shard_size)
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    pending: list[tuple[str, str]] = []  # (temporary, final)
    try:
        bar = _progress(total=len(shards), desc="saving", enabled=progress)
        for name, shard in zip(names, shards):
            final = os.path.join(path, name)
            tmp = _tmp_name(final)
            # clone: packed projections are views of one storage, which safetensors refuses to write as is
            save_file({k: t.clone() for k, t in shard.items()}, tmp, metadata={"format": "pt"})
            pending.append((tmp, final))
            bar.update(1)
        bar.close()
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
            final = os.path.join(path, INDEX_FILE)
            pending.append((_write_atomic_json(index, final), final))
        cfg = config_to_dict(model.config)
        cfg["dtype"] = str(model.dtype).removeprefix("torch.")
        final = os.path.join(path, "config.json")
        pending.append((_write_atomic_json(cfg, final), final))
        final = os.path.join(path, GENERATION_CONFIG_FILE)
        pending.append((_write_atomic_json(generation_config_dict(model.generation_config), final), final))
    except BaseException:
        for tmp, _ in pending:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    for tmp, final in pending:
        os.replace(tmp, final)
    # Files of an earlier save with a different sharding would now be stale: remove them last.
    keep = set(names) | ({INDEX_FILE} if len(shards) > 1 else set())
    for f in os.listdir(path):
        if (re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", f)) and f not in keep:
            os.remove(os.path.join(path, f))


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; degrade quietly without it
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="t" if desc == "loading" else "shard")
