"""Held-out quality of quantized artifacts against the float one (docs/quantization.md).

Exports the checkpoint once in float and once per scheme (int8; int4 block 32 and 128; int4 with
an int8 head; int4 block 32 asymmetric; each RTN, symmetric unless said, MatMulNBits
accuracy_level 4 as exported by default), runs each artifact's verify graph (W = 32 rows a
call, fp32 activations, the CPU) over the same held-out windows, and reports per scheme:
held-out cross-entropy (nats/token), bits/byte, top-1 agreement with the float artifact's
argmax, and the weights file's size. What is measured is the artifact itself, int8 activations
included, not a dequantized torch model.

    python -m tools.quality.quant_quality --checkpoint demo --windows 16 --seq 512 --out q.json
    python -m tools.quality.quant_quality --checkpoint HF_DIR --genai GENAI_DIR --windows 8 --seq 512

The demo's held-out tokens are ``.corpus/heldout.npy`` (tools/demo_model/pack_demo_corpus.py);
when it is missing the held-out split alone is packed (a few seconds). Any other checkpoint
folder: the same held-out split (this interpreter's stdlib) tokenized with the folder's
tokenizer.json. bits/byte = CE / ln 2 × tokens per byte of the held-out split, as in
docs/demo-model.md. ``--genai DIR``: also an ORT-GenAI model folder of the same checkpoint (its
builder's output), scored on the same windows through onnxruntime_genai: each window is one
prompt, whose logits output holds every position's row.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.loading.artifact import open_artifact

from loopcast.quant import QuantScheme, WeightFormat

WIDTH = 32  # verify rows a call (the exporter's maximum)
SCHEMES: dict[str, QuantScheme | None] = {
    "float (fp32)": None,
    "int8 block 32": QuantScheme(WeightFormat.INT8, 32, head=WeightFormat.INT8),
    "int4 block 32": QuantScheme(WeightFormat.INT4, 32, head=WeightFormat.INT4),
    "int4 block 128": QuantScheme(WeightFormat.INT4, 128, head=WeightFormat.INT4),
    "int4 block 32, int8 head": QuantScheme(WeightFormat.INT4, 32, head=WeightFormat.INT8),
    "int4 block 32 asymmetric": QuantScheme(WeightFormat.INT4, 32, symmetric=False, head=WeightFormat.INT4),
}


def heldout_tokens(data: Path) -> tuple[np.ndarray, float]:
    """The held-out token array and its tokens per byte (packing the split when missing)."""
    path = data / "heldout.npy"
    meta_path = data / "heldout_meta.json"
    if not path.is_file():
        from tools.demo_model.pack_demo_corpus import DEFAULT_TOKENIZER, load_tokenizer, pack_split

        data.mkdir(parents=True, exist_ok=True)
        entry = pack_split(load_tokenizer(DEFAULT_TOKENIZER), "heldout", data, None)
        meta_path.write_text(json.dumps(entry, indent=1))
    if meta_path.is_file():
        entry = json.loads(meta_path.read_text())
    else:  # packed by pack_demo_corpus: corpus_meta.json holds every split
        entry = json.loads((data / "corpus_meta.json").read_text())["splits"]["heldout"]
    return np.load(path), entry["n_tokens"] / entry["n_bytes"]


def stdlib_windows(tokenizer_json: Path, windows: int, seq: int) -> tuple[list[np.ndarray], float]:
    """``windows`` windows of ``seq + 1`` tokens evenly spaced over the stdlib held-out split
    (tools/demo_model/demo_corpus.py) tokenized with ``tokenizer_json``, and the split's tokens
    per byte."""
    from tokenizers import Tokenizer

    from tools.demo_model.demo_corpus import read_split_with_paths

    texts = [text for _, text in read_split_with_paths("heldout", None)]
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    ids = np.concatenate([np.asarray(e.ids, np.int64) for e in encoded])
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    starts = np.linspace(0, len(ids) - seq - 2, windows).astype(int)
    return [ids[s : s + seq + 1] for s in starts], len(ids) / n_bytes


def genai_window_logits(model_dir: Path, windows: list[np.ndarray]) -> list[np.ndarray]:
    """An ORT-GenAI model folder, teacher-forced: each window appended to a fresh greedy
    generator as its prompt, whose logits output then holds every position's [seq, V] row."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    out = []
    for tokens in windows:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(tokens) + 1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([tokens.astype(np.int32).tolist()])
        out.append(np.asarray(generator.get_output("logits")[0], np.float64))
    return out


def bits_per_byte(logits: list[np.ndarray], windows: list[np.ndarray], tokens_per_byte: float) -> float:
    """Mean CE of each window's next tokens (``windows`` hold seq + 1 tokens) in bits per byte."""
    scored = sum(len(w) - 1 for w in windows)
    ce = sum(cross_entropy(lg, w[1:]) for lg, w in zip(logits, windows, strict=True)) / scored
    return ce / math.log(2) * tokens_per_byte


def window_logits(artifact: Path, windows: list[np.ndarray]) -> list[np.ndarray]:
    """Per window, the [seq, V] logits of each position given the ones before it (verify rows)."""
    loaded = open_artifact(artifact)
    gen, width = Generator(loaded), loaded.manifest.verify_width
    out = []
    for tokens in windows:
        gen.rewind(0)
        rows = []
        for at in range(0, len(tokens), width):
            chunk = tokens[at : at + width].tolist()
            step = gen.run("verify", gen.n, tokens=chunk)
            rows.append(np.asarray(step.logits[: len(chunk)], np.float64))
            gen.commit(chunk)
        out.append(np.concatenate(rows))
    return out


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed CE (nats) of ``targets`` under ``logits`` [S, V]."""
    top = logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return float((log_z - logits[np.arange(len(targets)), targets]).sum())


def score(
    label: str, logits: list[np.ndarray], windows: list[np.ndarray], float_top1, tokens_per_byte: float
):
    """One table row: CE, bits/byte and top-1 agreement with ``float_top1`` (per-window argmax
    arrays; ``None``: this row is the float one)."""
    targets = [w[1:] for w in windows]
    scored = sum(len(t) for t in targets)
    ce = sum(cross_entropy(lg, t) for lg, t in zip(logits, targets, strict=True)) / scored
    top1 = [lg.argmax(axis=1) for lg in logits]
    reference = top1 if float_top1 is None else float_top1
    agree = sum(int((a == b).sum()) for a, b in zip(top1, reference, strict=True)) / scored
    row = {"scheme": label, "ce_nats": ce, "bits_per_byte": ce / math.log(2) * tokens_per_byte}
    return row | {"top1_agreement_with_float": agree}, top1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="demo")
    p.add_argument("--data", type=Path, default=Path(".corpus"))
    p.add_argument("--windows", type=int, default=16, help="held-out windows, evenly spaced")
    p.add_argument("--seq", type=int, default=512, help="tokens a window (a multiple of 32)")
    p.add_argument("--genai", type=Path, default=None, help="an ORT-GenAI model folder to score beside")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.checkpoint == "demo":
        heldout, tokens_per_byte = heldout_tokens(args.data)
        starts = np.linspace(0, len(heldout) - args.seq - 2, args.windows).astype(int)
        windows = [heldout[s : s + args.seq + 1].astype(np.int64) for s in starts]
    else:
        windows, tokens_per_byte = stdlib_windows(
            Path(args.checkpoint) / "tokenizer.json", args.windows, args.seq
        )
    inputs = [w[:-1] for w in windows]
    rows, float_top1 = [], None
    with tempfile.TemporaryDirectory() as work:
        for label, scheme in SCHEMES.items():
            art = Path(work) / label.replace(" ", "_").replace(",", "")
            options = ExportOptions(max_length=args.seq, verify_width=WIDTH, quantization=scheme)
            export_checkpoint(args.checkpoint, art, options)
            t0 = time.perf_counter()
            logits = window_logits(art, inputs)
            row, top1 = score(label, logits, windows, float_top1, tokens_per_byte)
            float_top1 = top1 if float_top1 is None else float_top1
            row["weights_mib"] = (art / "weights.safetensors").stat().st_size / 2**20
            rows.append(row | {"eval_seconds": time.perf_counter() - t0})
        if args.genai is not None:
            logits = genai_window_logits(args.genai, inputs)
            row, _ = score(f"ORT-GenAI {args.genai.name}", logits, windows, float_top1, tokens_per_byte)
            data = [f for f in args.genai.iterdir() if f.name.endswith((".onnx", ".onnx.data"))]
            rows.append(row | {"weights_mib": sum(f.stat().st_size for f in data) / 2**20})
    for row in rows:
        print(
            f"{row['scheme']:28s} CE {row['ce_nats']:.4f}  bits/byte {row['bits_per_byte']:.4f}  "
            f"top-1 vs float {row['top1_agreement_with_float']:.2%}  weights {row['weights_mib']:.1f} MiB",
            flush=True,
        )
    if args.out:
        scored = sum(len(w) - 1 for w in windows)
        report = {"checkpoint": args.checkpoint, "windows": args.windows, "seq": args.seq}
        report |= {"scored_tokens": scored, "tokens_per_byte": tokens_per_byte, "rows": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
