"""lm-evaluation-harness against a served cluster, checked against lm-eval's own HF backend.

A user evaluating a served model runs lm-eval's ``local-completions`` model against the
server: every loglikelihood is a completions request with token ids, ``echo: true``,
``logprobs: 1`` and ``max_tokens: 1`` (``lm_eval/models/openai_completions.py``), read back from
the prompt's logprobs. This runs that client, unchanged, against ``splitserve up --prefill 1
--decode 1`` in float32 (prompts computed on the prefill worker, KV pushed over UCX), and
the same task with lm-eval's ``hf`` model on the same GGUF in float32, then compares each
choice's loglikelihood and ``is_greedy`` and the task's accuracy.

The task is a small multiple-choice set written here (``QUESTIONS``: no dataset hub is
reachable), as a local lm-eval task (``dataset_path: json``). lm-eval lives in its own venv:

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 \\
        "lm-eval[api,hf]==0.4.13" transformers==5.24.0 gguf
    .venv/bin/python bench/bench_lm_eval.py --lm-eval /tmp/lmeval/bin/lm_eval
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from cluster_process import LocalCluster

from splitserve.common.cpu_info import cpu_name
from splitserve.common.model_files import default_model_path

Json = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TASK = "splitserve_mc"
QUESTIONS: list[tuple[str, tuple[str, ...], int]] = [
    ("The capital of France is", (" Paris", " Berlin", " Madrid", " Rome"), 0),
    ("Water freezes at zero degrees", (" Celsius", " Fahrenheit", " Kelvin", " Rankine"), 0),
    ("The largest planet in the solar system is", (" Jupiter", " Mars", " Venus", " Mercury"), 0),
    ("A week has seven", (" days", " hours", " months", " years"), 0),
    ("The opposite of hot is", (" cold", " warm", " loud", " fast"), 0),
    ("Bees make", (" honey", " milk", " silk", " wool"), 0),
    ("The sun rises in the", (" east", " west", " north", " south"), 0),
    ("Two plus two equals", (" four", " five", " three", " six"), 0),
    ("The color of the clear sky is", (" blue", " green", " red", " purple"), 0),
    ("Cats often chase", (" mice", " cars", " clouds", " books"), 0),
    ("Shakespeare wrote", (" plays", " symphonies", " software", " recipes"), 0),
    ("The chemical symbol for gold is", (" Au", " Ag", " Fe", " Pb"), 0),
    ("A triangle has three", (" sides", " wheels", " colors", " names"), 0),
    ("Ice is frozen", (" water", " fire", " sand", " glass"), 0),
    ("The first month of the year is", (" January", " March", " July", " October"), 0),
    ("Fish live in", (" water", " trees", " deserts", " clouds"), 0),
    ("The Earth orbits the", (" Sun", " Moon", " Mars", " comet"), 0),
    ("A doctor works in a", (" hospital", " bakery", " garage", " forest"), 0),
    ("Paper is made from", (" wood", " iron", " glass", " oil"), 0),
    ("The number after nine is", (" ten", " eight", " seven", " twelve"), 0),
]
"""(question, choices, index of the right one): everyday facts a 135M model mostly knows."""


def write_task(folder: Path) -> None:
    """The questions as a local lm-eval multiple-choice task in ``folder``."""
    data = folder / "questions.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": list(c), "gold": g}) + "\n"
            for q, c, g in QUESTIONS
        )
    )
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    )


def export_tokenizer(folder: Path) -> None:
    """The default model's tokenizer as an HF tokenizer folder (lm-eval tokenizes with it)."""
    import transformers

    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(folder)


def run_lm_eval(lm_eval: Path, model: str, model_args: str, tasks: Path, out: Path) -> float:
    """One lm-eval run of the task (its samples logged under ``out``); its seconds."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        str(lm_eval), "--model", model, "--model_args", model_args, "--tasks", TASK,
        "--include_path", str(tasks), "--log_samples", "--output_path", str(out),
        "--batch_size", "1",
    ]  # fmt: skip
    if model == "hf":
        command += ["--device", "cpu"]
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return time.perf_counter() - started


def samples(out: Path) -> dict[int, list[tuple[float, bool]]]:
    """Each question's (loglikelihood, is_greedy) per choice, from the logged samples."""
    (path,) = out.glob(f"*/samples_{TASK}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        row["doc_id"]: [(float(value), flag == "True") for value, flag in row["filtered_resps"]]
        for row in rows
    }


def accuracy(out: Path) -> float:
    (path,) = out.glob("*/results_*.json")
    return json.loads(path.read_text())["results"][TASK]["acc,none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", type=Path, required=True, help="lm-eval's lm_eval command")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        write_task(work)
        export_tokenizer(work / "tokenizer")
        splitserve = ROOT / ".venv" / "bin" / "splitserve"
        flags = ["--prefill", "1", "--decode", "1", "--", "--dtype", "float32"]
        with LocalCluster(splitserve, flags, work / "up.log") as cluster:
            served_args = (
                f"model={default_model_path().name.removesuffix('.gguf')},"
                f"base_url={cluster.http_url}/v1/completions,tokenizer={work / 'tokenizer'},"
                "num_concurrent=1,max_retries=1,tokenized_requests=True"
            )
            served_s = run_lm_eval(
                args.lm_eval, "local-completions", served_args, work, work / "served"
            )
        path = default_model_path()
        hf_args = (
            f"pretrained={path.parent},gguf_file={path.name},"
            f"tokenizer={work / 'tokenizer'},dtype=float32"
        )
        hf_s = run_lm_eval(args.lm_eval, "hf", hf_args, work, work / "hf")
        served, reference = samples(work / "served"), samples(work / "hf")
        pairs = [
            (s, r)
            for doc in sorted(reference)
            for s, r in zip(served[doc], reference[doc], strict=True)
        ]
        report: Json = {
            "cpu": cpu_name(),
            "client": "lm-eval 0.4.13, local-completions (echo + logprobs=1, token ids)",
            "cluster": "splitserve up --prefill 1 --decode 1, float32, KV over UCX",
            "reference": "lm-eval's hf model on the same GGUF, float32",
            "questions": len(QUESTIONS),
            "loglikelihoods": len(pairs),
            "max_abs_loglikelihood_diff": max(abs(s[0] - r[0]) for s, r in pairs),
            "is_greedy_agree": sum(s[1] == r[1] for s, r in pairs),
            "accuracy": {"served": accuracy(work / "served"), "hf": accuracy(work / "hf")},
            "wall_s": {"served": round(served_s, 1), "hf": round(hf_s, 1)},
        }
    print(json.dumps(report, indent=2))
    out = args.out or RESULTS / f"lm-eval-{date.today().isoformat()}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
