"""The scale model: time and cost to pretrain BERT-base and BERT-large with BERT's recipe on 1, 8 and
64 GPUs, and prepare's time on N machines, from measured figures (each read from its file).

Inputs, each from the file named in the output:

- one H200's bf16 BERT-base step at seq 128 (the fastest row with BERT's dropout of the lever ladder,
  ``docs/benchmarks/gpu_check_h200/command_8_levers/levers.json``) and the padding of the corpus it
  ran on (``.../command_3_paths/paths.json``): positions per second = real tokens/s / (1 - padding),
  as the padded path computes every position;
- the multi-process scaling efficiency measured on CPU (``docs/benchmarks/scaling_cpu.json``);
- prepare's seconds per stage, the vocabulary stage included, for 1 GB of generated text on a 2-vCPU
  machine with ``data.num_proc=2``, idle (``docs/benchmarks/prepare_scale_1GB_idle.json``) and its peak memory per
  share (``docs/benchmarks/prepare_shards_cpu.json``).

Other models and lengths are projected at the measured MFU: positions/s scale with the inverse of the
FLOPs per position that bert_mp's MFU counts (``pretrain/monitors.py: step_flops``), rows full.

    python scripts/bench/scale_model.py > /tmp/scale.md      # the tables of docs/scale.md
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEVERS = "docs/benchmarks/gpu_check_h200/command_8_levers/levers.json"
PATHS = "docs/benchmarks/gpu_check_h200/command_3_paths/paths.json"
SCALING = "docs/benchmarks/scaling_cpu.json"
PREPARE = "docs/benchmarks/prepare_scale_1GB_idle.json"
SHARDS = "docs/benchmarks/prepare_shards_cpu.json"
BEST_LEVER = "cuda_graphs"
"""The fastest ladder row that keeps BERT's dropout (the faster ``+no_dropout`` row changes the recipe)."""

# BERT's recipe (Devlin et al. 2018, section A.2): 1,000,000 steps of 256 sequences, 90% of them at
# 128 tokens and the rest at 512; Wikipedia + BooksCorpus, 3.3 billion words (section 3.1).
RECIPE_STEPS, RECIPE_BATCH = 1_000_000, 256
PHASES = ((128, 0.9), (512, 0.1))
CORPUS_WORDS = 3.3e9
BYTES_PER_WORD = 6.0
"""An assumption, not a measurement: English words average about five letters, plus a space."""
MLM_SHARE = 0.15


@dataclass(frozen=True)
class Shape:
    """A BERT's sizes (the presets of ``bert_mp/model/bert.py``), vocabulary of bert-base-uncased."""

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int = 30528

    def flops_per_position(self, seq: int) -> float:
        """Training FLOPs per position of a full row of ``seq`` tokens, counted as bert_mp's MFU counts
        them: 6 x matmul parameters, attention 12 x layers x hidden x seq, the MLM head on 15% of the
        positions, the pooler and NSP head once a row."""
        h = self.hidden
        encoder = self.layers * (4 * h * h + 2 * h * self.ffn)
        attention = 12 * self.layers * h * seq
        mlm = MLM_SHARE * 6 * (h * h + h * self.vocab)
        nsp = 6 * (h * h + 2 * h) / seq
        return 6 * encoder + attention + mlm + nsp


BASE = Shape("BERT-base", 12, 768, 3072)
LARGE = Shape("BERT-large", 24, 1024, 4096)


def _read(path: str) -> dict:
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


def quiet_round(report: dict) -> dict:
    """The round of the scaling benchmark that met the least other work (the largest share of the
    cores any of its runs saw used by other processes is the smallest), and each strategy's
    2-process efficiency in it: on a shared machine the fairest of the measured rounds."""
    runs = report["runs"]
    rounds = sorted({r["round"] for r in runs})
    busy = {k: max(r["others_cpu_cores"] or 0.0 for r in runs if r["round"] == k) for k in rounds}
    k = min(rounds, key=lambda r: busy[r])
    per = {s: v["2"]["efficiency_per_round"][rounds.index(k)] for s, v in report["efficiency"].items()}
    medians = {s: v["2"]["efficiency"] for s, v in report["efficiency"].items()}
    return {"round": k, "others_cpu_cores": busy[k], "efficiency": per, "median_efficiency": medians}


def measured() -> dict:
    """Every input figure, with the file it comes from."""
    levers = _read(LEVERS)["levers"]
    row = next(r for r in levers["ladder"] if r["lever"] == BEST_LEVER)
    padding = _read(PATHS)["bench"]["corpora"]["builtin"]["padding_fraction_at_max_seq_length"]
    scaling = quiet_round(_read(SCALING))
    scale = _read(PREPARE)
    size = scale.get("size") or max(scale["learned"], key=lambda k: scale["corpora"][k]["bytes"])
    prep = scale["learned"][size]
    shards_path = ROOT / SHARDS
    shards = json.loads(shards_path.read_text()) if shards_path.is_file() else None
    return {
        "gpu": {
            "file": LEVERS,
            "device": levers["device"],
            "row": BEST_LEVER,
            "tokens_per_sec": row["tokens_per_sec"],
            "mfu": row["mfu"],
            "setup": levers["setup"],
            "versions": levers["versions"],
        },
        "padding": {"file": PATHS, "fraction": padding},
        "scaling": {"file": SCALING, **scaling},
        "prepare": {
            "file": PREPARE,
            "corpus_bytes": scale["corpora"][size]["bytes"],
            "num_proc": scale["num_proc"],
            "stage_seconds": prep["stage_seconds"],
            "vocabulary": prep["vocabulary"],
            "peak_anon_bytes": prep["memory_peaks_bytes"]["anon_total"],
        },
        "shards": {"file": SHARDS, **shards["summary"]} if shards and "summary" in shards else None,
    }


def training_table(m: dict, efficiency: float, gpus: tuple[int, ...], usd_per_gpu_hour: float) -> list[dict]:
    """Wall hours and GPU-hours of BERT's recipe per model and GPU count."""
    pos_per_sec = m["gpu"]["tokens_per_sec"] / (1 - m["padding"]["fraction"])
    base_flops = BASE.flops_per_position(m["gpu"]["setup"]["seq"])
    rows = []
    for shape in (BASE, LARGE):
        seconds_one = sum(
            RECIPE_STEPS
            * share
            * RECIPE_BATCH
            * seq
            / (pos_per_sec * base_flops / shape.flops_per_position(seq))
            for seq, share in PHASES
        )
        for n in gpus:
            eff = 1.0 if n == 1 else efficiency
            seconds = seconds_one / (n * eff)
            rows.append(
                {
                    "model": shape.name,
                    "gpus": n,
                    "efficiency": eff,
                    "hours": seconds / 3600,
                    "gpu_hours": seconds * n / 3600,
                    "usd": seconds * n / 3600 * usd_per_gpu_hour,
                }
            )
    return rows


def prepare_parts(m: dict, whole_vocabulary: bool = False) -> dict[str, float]:
    """Seconds of each part of prepare for Wikipedia + BooksCorpus with the measured number of
    processes: every stage scaled by bytes from the measurement, but the vocabulary's alphabet and
    training, which read a sample of bounded size (the same seconds at any corpus size: only drawing
    the sample, a pass over the documents, grows with the corpus) - unless ``whole_vocabulary``
    (``data.vocab_sample_chars=null``), when they read the whole corpus and grow with it (characters
    taken as bytes: the text is ASCII)."""
    p = m["prepare"]
    corpus = CORPUS_WORDS * BYTES_PER_WORD
    scale = corpus / p["corpus_bytes"]
    st, voc = p["stage_seconds"], p["vocabulary"]
    learn = voc["seconds"]["alphabet"] + voc["seconds"]["train"]
    if whole_vocabulary:
        learn *= corpus / voc["characters"]
    loading = st["tokenizer"] - sum(voc["seconds"].values())  # saving the tokenizer: the same at any size
    staged = ("read", "tokenizer", "split_tokenize_pair", "write")
    return {
        "read": st["read"] * scale,
        "vocabulary": voc["seconds"]["sample"] * scale + learn + loading,
        "tokenize_pair": st["split_tokenize_pair"] * scale,
        "write": st["write"] * scale,
        "rest": (st["total"] - sum(st[k] for k in staged)) * scale,
    }


def prepare_table(m: dict, machines: tuple[int, ...]) -> list[dict]:
    """Hours to prepare Wikipedia + BooksCorpus on N machines like the measured one (``data.shard``):
    every machine reads the whole corpus and learns the vocabulary from its sample (the same on
    every share); the rest divides by N."""
    parts = prepare_parts(m)
    shared = parts["tokenize_pair"] + parts["write"] + parts["rest"]
    return [
        {
            "machines": n,
            "hours": (parts["read"] + parts["vocabulary"] + shared / n) / 3600,
            "read_hours": parts["read"] / 3600,
            "vocabulary_hours": parts["vocabulary"] / 3600,
        }
        for n in machines
    ]


def cores_table(m: dict, cores: tuple[int, ...]) -> list[dict]:
    """Hours to prepare Wikipedia + BooksCorpus on one machine with ``data.num_proc`` = its cores, the
    vocabulary from the default sample or from the whole corpus: reading and tokenizing divide over
    the processes (one reader per 32 MB of files, one pairing worker per process); learning the
    vocabulary is one thread, writing one process."""
    rows = []
    for whole in (False, True):
        parts = prepare_parts(m, whole_vocabulary=whole)
        for c in cores:
            per_core = m["prepare"]["num_proc"] / c
            hours = {
                **parts,
                "read": parts["read"] * per_core,
                "tokenize_pair": parts["tokenize_pair"] * per_core,
            }
            total = sum(hours.values())
            rows.append(
                {
                    "cores": c,
                    "vocabulary_from": "the whole corpus" if whole else "the sample",
                    "hours": total / 3600,
                    "vocabulary_hours": parts["vocabulary"] / 3600,
                    "vocabulary_share": parts["vocabulary"] / total,
                }
            )
    return rows


def markdown(m: dict, usd: float) -> str:
    """The tables of docs/scale.md."""
    ddp = m["scaling"]["efficiency"]["ddp"]
    ideal = {(r["model"], r["gpus"]): r for r in training_table(m, 1.0, (1, 8, 64), usd)}
    real = {(r["model"], r["gpus"]): r for r in training_table(m, ddp, (1, 8, 64), usd)}
    lines = [
        f"| model | GPUs | wall hours, ideal scaling | wall hours at {ddp:.2f} | GPU-hours at {ddp:.2f} "
        f"| USD at {usd:g} per GPU-hour |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, r in real.items():
        lines.append(
            f"| {key[0]} | {key[1]} | {ideal[key]['hours']:,.2f} | {r['hours']:,.2f} | "
            f"{r['gpu_hours']:,.0f} | {r['usd']:,.0f} |"
        )
    lines += [
        "",
        "| machines | prepare hours | of which reading the whole corpus | of which the vocabulary |",
        "| ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['machines']} | {r['hours']:.2f} | {r['read_hours']:.2f} | {r['vocabulary_hours']:.3f} |"
        for r in prepare_table(m, (1, 8, 64))
    ]
    lines += [
        "",
        "| cores (`data.num_proc`) | vocabulary from | prepare hours | of which the vocabulary | its share |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['cores']} | {r['vocabulary_from']} | {r['hours']:.2f} | {r['vocabulary_hours']:.3f} | "
        f"{r['vocabulary_share']:.1%} |"
        for r in cores_table(m, (2, 16))
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--usd-per-gpu-hour", type=float, default=3.5, help="an assumed H200 price (not measured)")
    p.add_argument("--json", action="store_true", help="the inputs and tables as JSON")
    args = p.parse_args(argv)
    m = measured()
    if args.json:
        out = {
            "inputs": m,
            "training": training_table(
                m, m["scaling"]["efficiency"]["ddp"], (1, 8, 64), args.usd_per_gpu_hour
            ),
            "prepare": prepare_table(m, (1, 8, 64)),
            "prepare_on_one_machine": cores_table(m, (2, 16)),
        }
        print(json.dumps(out, indent=1))
    else:
        print(markdown(m, args.usd_per_gpu_hour), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
