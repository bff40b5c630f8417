"""Local transformers folders, read as data: never code, never a loader option from a file.

transformers runs a folder's own Python when its ``config.json`` (or ``tokenizer_config.json``)
has an ``auto_map`` and ``trust_remote_code`` is true (and, left unset, asks on a terminal).
So every transformers call longctx makes on a folder (``model=hf``, the probe, eval ``--hf``,
verify) first passes :func:`check_no_remote_code`, which refuses such a folder in one line before
transformers sees it, and then passes :data:`LOCAL_ONLY` explicitly. The same check refuses a
config.json that names attention other than transformers' local ones (:data:`LOCAL_ATTENTION`):
``attn_implementation: "<org>/<repo>"`` is a hub kernel transformers would download and run.

A *loader option* (:data:`LOADER_OPTIONS`) is a keyword of ``from_pretrained`` that decides whose
code runs, where files come from, or how they are fetched. It is longctx's to set, never a
stored run record's or ``model.config_overrides``'s: an override is a field of the model's
config (``max_position_embeddings``, ``sliding_window``, RoPE settings), nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

from longctx.errors import LongctxError

CONFIG_FILE = "config.json"
# the files whose auto_map makes transformers import the folder's own modules
CODE_MAP_FILES = (CONFIG_FILE, "tokenizer_config.json")
# every from_pretrained / from_config call longctx makes passes these
LOCAL_ONLY = {"trust_remote_code": False, "local_files_only": True}
LOADER_OPTIONS = frozenset(
    {
        "trust_remote_code", "code_revision", "revision", "token", "use_auth_token",
        "cache_dir", "force_download", "resume_download", "local_files_only", "subfolder",
        "proxies", "mirror", "user_agent", "from_pipeline", "from_auto", "gguf_file",
        "return_unused_kwargs", "pretrained_model_name_or_path", "name_or_path", "config",
        "state_dict", "device_map", "max_memory", "offload_folder", "quantization_config",
        "variant", "use_safetensors", "weights_only", "key_mapping", "tp_plan", "adapter_name",
    }
)  # fmt: skip
# config keywords longctx sets from its own options, not from an override
LONGCTX_OPTIONS = {
    "dtype": "model.dtype",
    "torch_dtype": "model.dtype",
    "attn_implementation": "model.attn_backend",
    "experts_implementation": "model.attn_backend",
}


# the attention a folder's config.json may name: transformers' own, computed locally. Any other
# is code from elsewhere: "<org>/<repo>" is a hub kernel transformers downloads, and
# flash_attention_2/3 fall back to one when flash_attn is not installed.
LOCAL_ATTENTION = frozenset({"eager", "sdpa", "flex_attention"})
ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")


class RemoteCodeRefused(LongctxError):
    """A folder that ships model or tokenizer code of its own."""


def read_config_json(folder: Path, name: str = CONFIG_FILE) -> dict:
    """A folder's JSON file as a dict; one line naming it when it is not a JSON object."""
    path = folder / name
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # nested too deep
        raise LongctxError(f"{path} cannot be read as JSON ({err}); expected a transformers "
                         f"{name}") from None  # fmt: skip
    if not isinstance(data, dict):
        raise LongctxError(f"{path} holds a {type(data).__name__}; expected a JSON object")
    return data


def check_no_remote_code(folder: str | Path) -> None:
    """Refuse a folder whose config.json or tokenizer_config.json has an ``auto_map`` (code of
    its own, which longctx never runs), or whose config.json names attention code from elsewhere
    (a hub kernel: a download). Call before any transformers call on the folder."""
    folder = Path(folder)
    for name in CODE_MAP_FILES:
        if not (folder / name).is_file():
            continue
        config = read_config_json(folder, name)
        auto_map = config.get("auto_map")
        if name == CONFIG_FILE:
            _check_attention_named(config, folder)
        if auto_map:
            classes = sorted(auto_map) if isinstance(auto_map, dict) else auto_map
            raise RemoteCodeRefused(
                f"{folder} is refused: its {name} has auto_map ({classes}), code of its own "
                "that longctx never runs; use a folder of an architecture transformers ships "
                "(save_pretrained of a built-in class)"
            )


def _check_attention_named(config: dict, folder: Path, where: str = CONFIG_FILE) -> None:
    """Refuse a config.json (or a sub-config in it) naming attention other than
    :data:`LOCAL_ATTENTION`, as a value or in a per-sub-config dict."""
    for key, value in config.items():
        if key in ATTENTION_KEYS and value is not None:
            named = value.values() if isinstance(value, dict) else [value]
            if not all(v is None or (isinstance(v, str) and v in LOCAL_ATTENTION) for v in named):
                raise RemoteCodeRefused(
                    f"{folder} is refused: its {where} sets {key}={value!r}, attention code "
                    "transformers would fetch or pick for it (a hub kernel is downloaded); "
                    f"longctx chooses the attention itself: remove {key}, or set one of "
                    f"{sorted(LOCAL_ATTENTION)}"
                )
        if isinstance(value, dict):
            _check_attention_named(value, folder, f"{where} {key}")


def check_override_names(overrides: dict, where: str = "model.config_overrides") -> None:
    """Refuse an override that is a loader option, longctx's own option, or a private key, at
    any depth (a nested dict is a sub-config's fields)."""
    for key, value in overrides.items():
        if not isinstance(key, str) or key.startswith("_") or key in LOADER_OPTIONS:
            raise LongctxError(
                f"{where}.{key} is a loader option or private key, not a model config field; "
                "longctx loads local folders only, without their code (a stored or given "
                "config sets no loader option)"
            )
        if key in LONGCTX_OPTIONS and where == "model.config_overrides":
            raise LongctxError(
                f"{where}.{key} is set by longctx from {LONGCTX_OPTIONS[key]}; set that instead"
            )
        if isinstance(value, dict):
            check_override_names(value, f"{where}.{key}")
