"""A draft/target pair with the demo pair's shapes and tokenizer but random weights, for a machine
the real weights cannot reach.

    python -m benchmarks.random_pair --meta .gpu/demo-meta --out /tmp/random-pair --device cuda

The GPU machines this project is lent have no network and take at most 64 MiB of files per call:
the demo pair's 1.6 GB of GGUF cannot reach them. Forward costs depend on the shapes alone, not
on the weights, so a pair built from the demo pair's own ``config.json`` files (Qwen2.5-Coder
1.5B and 0.5B: 28 and 24 layers, hidden 1536 and 896, 151,936-token vocabulary) and its
tokenizer times like the real pair. ``--meta`` holds ``target/`` and ``draft/`` with those
files and no weights (``--export-meta`` writes it from the local demo cache).

Two drafts are written beside the target:

- ``draft``: the 0.5B shape with its own random weights. It is unrelated to the target, so its
  acceptance rate is about zero: what speculation costs when the draft is useless (and what
  adaptive K must turn off).
- ``draft-prefix``: the target's first ``--prefix-layers`` layers with its embeddings, final norm
  and output layer (self-speculation by layer skipping; Elhoushi et al. 2024, "LayerSkip",
  Section 4). To give it a real acceptance rate, the target's later layers are damped: their
  output projections (``o_proj``, ``down_proj``) are scaled by ``--damp``, so the target is its
  prefix plus a small random correction. The same target serves both drafts; its outputs are
  whatever these weights produce, and every benchmark checks speculation against the target
  alone on the same weights.

Acceptance rates and tokens/s of these pairs measure the engine and the hardware, not the demo
pair's quality: the demo pair's own acceptance (about 0.93 per token on code, README) is measured
on the CPU.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

#: The files of a model folder that are not weights (copied as they are).
META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja")


def export_meta(out: Path) -> Path:
    """Copy the demo pair's non-weight files (:data:`META_FILES`) from the local cache to ``out``.

    Raises:
        FileNotFoundError: the demo pair is not in the local cache (run ``specdec prefetch``).
    """
    from specdec.models.demo import ensure_demo_folder

    for role in ("target", "draft"):
        src = ensure_demo_folder(role)
        (out / role).mkdir(parents=True, exist_ok=True)
        for name in META_FILES if role == "target" else ("config.json", "generation_config.json"):
            if (src / name).exists():  # the draft's tokenizer is the target's (checked at load)
                shutil.copy2(src / name, out / role / name)
    return out


def _save(model, meta: Path, folder: Path) -> Path:
    """Save ``model`` with the generation config of ``meta`` and the tokenizer files of the
    target's meta folder (``meta/../target``: the pair shares its tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in META_FILES[1:]:
        src = meta / name if (meta / name).exists() else meta.parent / "target" / name
        if src.exists():
            shutil.copy2(src, folder / name)
    return folder


def build(meta: Path, out: Path, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          prefix_layers: int = 4, damp: float = 0.02) -> dict[str, Path]:
    """Write ``out/target``, ``out/draft`` and ``out/draft-prefix`` (module docstring).

    Args:
        meta: folder with ``target/`` and ``draft/`` config and tokenizer files.
        out: output folder.
        device: where the weights are initialised (``cuda`` is much faster for the 1.5B shape).
        dtype: weight dtype written.
        seed: torch seed of the random initialisation (transformers' own ``_init_weights``).
        prefix_layers: layers of the target kept by ``draft-prefix``.
        damp: factor on the output projections of the target's layers after the prefix.

    Returns:
        ``{"target": folder, "draft": folder, "draft-prefix": folder}``.

    Raises:
        ValueError: ``prefix_layers`` not below the target's layer count.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folders = {}
    tcfg = AutoConfig.from_pretrained(meta / "target")
    if not 0 < prefix_layers < tcfg.num_hidden_layers:
        raise ValueError(f"--prefix-layers {prefix_layers} must be in 1..{tcfg.num_hidden_layers - 1}")
    torch.manual_seed(seed)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(tcfg, dtype=dtype)
    with torch.no_grad():
        for layer in target.model.layers[prefix_layers:]:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    folders["target"] = _save(target, meta / "target", out / "target")
    dcfg = AutoConfig.from_pretrained(meta / "draft")
    with torch.device(device):
        draft = AutoModelForCausalLM.from_config(dcfg, dtype=dtype)
    folders["draft"] = _save(draft, meta / "draft", out / "draft")
    del draft
    pcfg = AutoConfig.from_pretrained(meta / "target")
    pcfg.num_hidden_layers = prefix_layers
    if getattr(pcfg, "layer_types", None):
        pcfg.layer_types = pcfg.layer_types[:prefix_layers]
    with torch.device(device):
        prefix = AutoModelForCausalLM.from_config(pcfg, dtype=dtype)
    own = target.state_dict()
    missing = prefix.load_state_dict({k: v for k, v in own.items() if k in prefix.state_dict()}, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    folders["draft-prefix"] = _save(prefix, meta / "target", out / "draft-prefix")
    return folders


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--meta", type=Path, required=True, help="folder with target/ and draft/ config + tokenizer files")
    p.add_argument("--out", type=Path, help="output folder of the pair")
    p.add_argument("--export-meta", action="store_true", help="write --meta from the local demo cache and stop")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-layers", type=int, default=4)
    p.add_argument("--damp", type=float, default=0.02)
    a = p.parse_args(argv)
    if a.export_meta:
        print(export_meta(a.meta))
        return 0
    if a.out is None:
        p.error("--out is required")
    if not (a.meta / "target" / "config.json").is_file() or not (a.meta / "draft" / "config.json").is_file():
        p.error(f"--meta {a.meta}: needs target/config.json and draft/config.json (write them with --export-meta)")
    try:
        folders = build(a.meta, a.out, device=a.device, seed=a.seed, prefix_layers=a.prefix_layers, damp=a.damp)
    except ValueError as e:
        p.error(str(e))
    for role, folder in folders.items():
        print(f"{role}: {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
