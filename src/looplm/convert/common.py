"""What every converter shares: reading a local folder of safetensors (single or sharded with an
index) without unpickling anything, checking its tensors against the shapes a config implies,
the tokenizer with the release's special tokens, and writing the looplm checkpoint atomically.

Every refusal is a `CheckpointError` with a one-line reason, raised before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from looplm.checkpoint import CONVERSION, CheckpointError, save_tensors, write_atomic, write_data_record, write_json
from looplm.config import ModelConfig
from looplm.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, None: torch.float32}


def refuse(message: str) -> CheckpointError:
    return CheckpointError(message)


def config_number(config: dict, name: str, default: float, kind: type = float, *, positive: bool = False):
    """config.json's `name` as `kind` (int or float), `default` when the key is absent; a value that is
    not such a number (a string, null, a fraction for an int), or not > 0 when `positive`, is refused
    naming the field (the source would not have loaded it either)."""
    value = config.get(name, default)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (kind is int and not float(value).is_integer()):
        raise refuse(f"config.json {name} = {value!r} is not {'an integer' if kind is int else 'a number'}")
    if positive and not value > 0:
        raise refuse(f"config.json {name} = {value!r} must be > 0")
    return kind(value)


def read_json(path: Path, what: str = "a release folder") -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise refuse(f"{path.parent}: no {path.name}; not {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise refuse(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise refuse(f"{path} does not hold a JSON object")
    return data


def folder_family(src: Path) -> str | None:
    """What `src` holds, judged from config.json alone (its model type first): "looplm" (a looplm checkpoint
    or run folder), "looplm-export" (a `looplm export` folder), a `--from` name, or None (not recognised:
    the converter asked for judges it)."""
    src = Path(src)
    if (src / "checkpoints").is_dir() or (src / "latest").is_file():
        return "looplm"  # a run folder, or its checkpoints/
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type == "looplm":
        return "looplm-export"
    if model_type == "huginn_raven" or "RavenForCausalLM" in archs:
        return "huginn"
    if model_type == "ouro" or "OuroForCausalLM" in archs:
        return "ouro"
    if model_type is not None:
        return None  # another Transformers family: the converter names what it lacks
    if (
        "Parcae" in (config.get("_class_name"), config.get("model_class_name"))
        or config.get("_class_name") == "ParcaeConfig"
    ):
        return "parcae"
    if isinstance(config.get("model"), dict):  # both keep the model's fields in a `model` section
        if (src / "manifest.json").is_file() and "depth" in config:
            return "looplm"
        if isinstance(config.get("tokenizer"), dict) or isinstance(config.get("student"), dict):
            return "xllm-loop"
    return None


def check_family(src: Path, family: str) -> None:
    """Refuse, before any converter reads it, a folder that holds looplm's own formats (nothing to convert)
    or another family than `family` (naming the --from that reads it)."""
    found = folder_family(src)
    if found == "looplm":
        raise refuse(f"{src} is a looplm checkpoint: no conversion needed (looplm eval {src} reads it)")
    if found == "looplm-export":
        raise refuse(
            f"{src} is a looplm export (config.json model_type 'looplm'): no conversion needed "
            f"(looplm eval {src} reads it)"
        )
    if found is not None and found != family:
        raise refuse(f"{src} looks like {found}, not {family}: use --from {found}")


def inside(src: Path, name: str) -> Path:
    """`src / name` for a relative path that stays inside src."""
    if not isinstance(name, str) or not name or name.startswith("/") or ".." in Path(name).parts:
        raise refuse(f"{src}: file name {name!r} points outside the folder")
    return src / name


def check_folders(src: Path, out: Path, dtype: str | None) -> None:
    """The source exists, the output is new or empty and differs from it, the dtype is known."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose fp32 or bf16")
    if not src.is_dir():
        raise refuse(f"no release folder at {src}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise refuse(f"{out} exists and is not empty; choose a new output folder")
    if out.resolve() == src.resolve():
        raise refuse("the output folder must differ from the source folder")


def refuse_pickles(src: Path) -> None:
    for path in sorted(src.rglob("*")):
        if path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES:
            raise refuse(
                f"{src}: {path.relative_to(src)} is a pickle file; looplm convert reads only "
                "safetensors and never unpickles (remove it or convert it to safetensors first)"
            )


def shard_map(src: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index (or one model.safetensors)."""
    if (src / INDEX).is_file():
        weight_map = read_json(src / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise refuse(f"{src / INDEX}: no 'weight_map'")
        for shard in set(weight_map.values()):
            if not str(shard).endswith(".safetensors"):
                raise refuse(f"{src / INDEX}: shard {shard!r} is not a .safetensors file")
            inside(src, shard)
        return dict(weight_map)
    if (src / SINGLE).is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(src / SINGLE), "pt") as f:
                return dict.fromkeys(f.keys(), SINGLE)
        except Exception as err:  # safetensors raises its own error types
            raise refuse(f"{src}: cannot read {SINGLE} ({err})") from None
    raise refuse(f"{src}: no {INDEX} or {SINGLE} (safetensors weights)")


def load_tensors(src: Path, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    missing = sorted(s for s in set(weight_map.values()) if not (src / s).is_file())
    if missing:
        raise refuse(f"{src}: shard {missing[0]} named in {INDEX} is missing")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        try:
            tensors = load_file(str(src / shard))
        except Exception as err:  # safetensors raises its own error types
            raise refuse(f"{src}: cannot read {shard} ({err})") from None
        expected = {k for k, v in weight_map.items() if v == shard}
        if set(tensors) != expected:
            extra, absent = sorted(set(tensors) - expected), sorted(expected - set(tensors))
            raise refuse(
                f"{src}: {shard} does not hold the tensors {INDEX} assigns it "
                f"(missing {absent[:3]}, unexpected {extra[:3]})"
            )
        state.update(tensors)
    return state


def read_checked(
    src: Path,
    expected: dict[str, tuple[int, ...]],
    optional: dict[str, tuple[int, ...]] | None = None,
    *,
    family: str,
    ignore: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """The folder's tensors as float32, after checking that the names are exactly `expected` (plus
    any of `optional`) and that every shape is the one the config implies; tensors named in `ignore`
    (derived buffers such as RoPE tables) are read past and dropped."""
    optional = optional or {}
    weight_map = shard_map(src)
    dropped = set(weight_map) & set(ignore)
    unknown = sorted(set(weight_map) - set(expected) - set(optional) - dropped)
    missing = sorted(set(expected) - set(weight_map))
    if unknown:
        raise refuse(
            f"{src}: unknown tensor {unknown[0]} ({len(unknown)} unknown): not a {family} model of this config"
        )
    if missing:
        raise refuse(f"{src}: missing tensor {missing[0]} ({len(missing)} missing)")
    missing_shards = sorted(s for s in set(weight_map.values()) if not (src / s).is_file())
    if missing_shards:
        raise refuse(f"{src}: shard {missing_shards[0]} named in {INDEX} is missing")
    state = {k: t for k, t in load_tensors(src, weight_map).items() if k not in dropped}
    for key, t in state.items():
        shape = expected.get(key, optional.get(key))
        if tuple(t.shape) != shape:
            raise refuse(f"{src}: {key} has shape {tuple(t.shape)}, config.json implies {shape}")
        if not t.is_floating_point():
            raise refuse(f"{src}: {key} is {t.dtype}, expected a floating-point tensor")
    return {k: t.float() for k, t in state.items()}


def open_source(src: Path, out: Path, dtype: str | None, what: str):
    """(config.json, tokenizer, tokenizer note) of an HF-style release folder, after the folder
    checks (`check_folders`, `refuse_pickles`); `what` names the folder kind in errors."""
    check_folders(src, out, dtype)
    refuse_pickles(src)
    config = read_json(src / "config.json", what)
    tokenizer, note = hf_tokenizer(src, config)
    return config, tokenizer, note


def check_vocab(tokenizer, cfg: ModelConfig) -> None:
    """The model's vocabulary holds every token id: a release may pad its embedding and head past the
    tokenizer (rows no token reaches), but a tokenizer larger than the model is refused."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise refuse(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's {cfg.vocab_size} embedding rows"
        )


def check_tied(src: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], head: str, embedding: str) -> None:
    """A release that declares tied embeddings but stores a different head is refused."""
    if cfg.tie_embeddings and head in state and not torch.equal(state[head], state[embedding]):
        raise refuse(f"{src}: config.json ties the embeddings but {head} differs from {embedding}")


def interleaved_to_half_split(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Permute the output rows of a q/k projection [n_heads*head_dim, ...] (or a bias
    [n_heads*head_dim]) per head so that the rows (2j, 2j+1) that interleaved RoPE rotates together
    become (j, j + head_dim/2), the pair that half-split RoPE rotates with the same frequency j.
    Scores q.k are unchanged (both permuted)."""
    perm = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim, *rest)[:, perm].reshape(n_heads * head_dim, *rest)


# -- tokenizer ---------------------------------------------------------------------------------------
def _special_name(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_id(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def hf_tokenizer(src: Path, config: dict):
    """The HF tokenizer of a release folder (tokenizer.json at its root) as a looplm BPETokenizer
    with the release's eos/pad tokens: named in special_tokens_map.json / tokenizer_config.json, or
    given as ids in config.json / generation_config.json, and the BOS token its texts start with
    (`looplm.data.tokenizer.bos_policy`). Returns (tokenizer, note or None)."""
    from tokenizers import Tokenizer as HFTokenizer

    from looplm.data.tokenizer import BPETokenizer, bos_policy

    if not (src / "tokenizer.json").is_file():
        raise refuse(f"{src}: no tokenizer.json; looplm checkpoints need the tokenizer")
    try:
        backend = HFTokenizer.from_file(str(src / "tokenizer.json"))
    except Exception as err:  # tokenizers raises its own error types
        raise refuse(f"{src}: cannot read tokenizer.json ({err})") from None
    names: dict[str, str | None] = {"eos_token": None, "pad_token": None}
    files = {
        fname: read_json(src / fname) if (src / fname).is_file() else {}
        for fname in ("special_tokens_map.json", "tokenizer_config.json")
    }
    for data in files.values():
        for key in names:
            names[key] = names[key] or _special_name(data.get(key))
    sources = [config] + (
        [read_json(src / "generation_config.json")] if (src / "generation_config.json").is_file() else []
    )
    for key in names:
        if names[key] is None:
            for data in sources:
                tid = _first_id(data.get(key + "_id"))
                if tid is not None:
                    names[key] = backend.id_to_token(tid)
                    if names[key] is None:
                        raise refuse(f"{src}: {key}_id {tid} is not a token of tokenizer.json")
                    break
    if names["eos_token"] is None:
        raise refuse(
            f"{src}: no eos_token in special_tokens_map.json or tokenizer_config.json, nor eos_token_id in config.json"
        )
    note = None
    if names["pad_token"] is None:
        names["pad_token"], note = names["eos_token"], "no pad_token in the release tokenizer: padding uses eos"
    try:
        bos = bos_policy(backend, files["tokenizer_config.json"], files["special_tokens_map.json"])
        tok = BPETokenizer.from_file(src / "tokenizer.json", names["eos_token"], names["pad_token"], bos)
    except (ValueError, TypeError) as err:
        raise refuse(f"{src}: {err}") from None
    return tok, note


# -- writing -------------------------------------------------------------------------------------------
def job_dict(cfg: ModelConfig, tokenizer_path: str, depth: int, data: str | None = None) -> dict:
    """config.json as a looplm run of this model would write it, evaluated at the release's default
    depth (a fixed-depth recipe). `data`: the text source `looplm eval`/`analyze` hold out from (a
    text file or folder, a .jsonl, "hf:<name>[:<split>]"); default: the built-in text corpus."""
    from looplm.depth.config import DepthConfig

    return release_job(
        cfg, DepthConfig(sampler="fixed", depth=float(depth), cap=max(64, cfg.max_depth)), tokenizer_path, data
    )


def release_job(cfg: ModelConfig, depth, tokenizer_path: str, data: str | None = None) -> dict:
    """The job dict of a converted release: the paper's S recipe with the release's model, depth
    recipe and tokenizer, holding out `data` (default: the built-in text corpus) for evaluation."""
    from looplm.data.record import BUILTIN_TEXT
    from looplm.train.config import job_preset

    job = job_preset("S")
    job = dataclasses.replace(
        job,
        model=cfg,
        depth=depth,
        data=dataclasses.replace(
            job.data,
            tokenizer=tokenizer_path,
            bpe_vocab_size=cfg.vocab_size,
            seq_len=min(job.data.seq_len, cfg.max_seq_len),
            source=data or BUILTIN_TEXT,
        ),
    )
    return job.resolved().to_dict()


def write_checkpoint(
    out: Path, weights: dict[str, torch.Tensor], job: dict, provenance: dict, tokenizer, dtype: str | None
) -> Path:
    """Write the looplm checkpoint folder atomically (nothing under `out` until it is complete)."""
    target = DTYPES[dtype]
    weights = {k: v.to(target).contiguous() for k, v in weights.items()}

    def populate(tmp: Path) -> None:
        save_tensors(tmp, "model.safetensors", weights)
        write_release_files(tmp, job, {**provenance, "dtype": str(target).removeprefix("torch.")}, tokenizer)

    if out.is_dir():
        out.rmdir()  # empty (checked before): write_atomic renames the finished folder into place
    return write_atomic(out, populate)


def write_release_files(tmp: Path, job: dict, provenance: dict, tokenizer) -> None:
    """Everything but the weights of a converted checkpoint: the job, its data record (the held-out
    text, origin 'converted'), the conversion's provenance and the release tokenizer."""
    from looplm.data.record import DataRecord

    write_json(tmp, "config.json", job)
    write_data_record(tmp, DataRecord.from_job(job, origin="converted"))
    write_json(tmp, CONVERSION, {**provenance, "bos_id": tokenizer.bos_id})
    tokenizer.save(tmp)


def check_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], src: Path) -> None:
    """The mapped weights load into a LoopedLM of `cfg` (a converter bug otherwise)."""
    from looplm.checkpoint import check_model_shapes
    from looplm.model import LoopedLM

    with torch.device("meta"):
        model = LoopedLM(cfg)
    check_model_shapes(model.state_dict(), weights, src)
