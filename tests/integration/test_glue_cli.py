"""``bert-mp glue`` interrupted and run again: killed after its first task (held at the ``glue:1`` point,
never raced), then stopped by SIGTERM inside its second - each rerun keeps what finished and goes on."""

import json
import os
import signal

from support import glue_checkpoint, hold_env, run_cli, start_cli, wait_held, write_glue_folder

RECIPE = [
    "finetune.max_seq_length=32",
    "finetune.batch_size=16",
    "finetune.learning_rate=3e-3",
    "finetune.epochs=2",
    "finetune.progress_bar=false",
]


def test_an_interrupted_suite_resumes_without_rerunning_finished_tasks(tmp_path):
    data = write_glue_folder(tmp_path / "glue", ("cola", "rte", "stsb"))
    ckpt = glue_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    args = [
        "glue",
        str(ckpt),
        "--data",
        str(data),
        "--tasks",
        "cola,rte,stsb",
        *RECIPE,
        f"glue.output_dir={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    # 1. killed outright once the first task's results are written
    ready = tmp_path / "held"
    proc = start_cli(*args, cwd=tmp_path, env={**env, **hold_env("glue:1", ready)})
    wait_held(proc, ready)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    partial = json.loads((out / "glue.json").read_text())
    assert (
        partial["tasks"]["cola"]["status"] == "completed" and partial["tasks"]["rte"]["status"] == "pending"
    )
    cola = out / "cola" / "summary.json"
    cola_written = (cola.stat().st_mtime_ns, cola.read_text())

    # 2. again: cola is kept; stopped by SIGTERM at rte's second step (it saves a checkpoint)
    proc = start_cli(*args, cwd=tmp_path, env={**env, **hold_env("step:2", ready)})
    wait_held(proc, ready)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    assert "[1/3] cola: completed earlier, kept" in stdout
    steps = json.loads((out / "rte" / "summary.json").read_text())["steps"]
    assert (
        f"rte stopped after {steps} steps (signal SIGTERM)" in stdout
        and "run the same command again" in stdout
    )
    assert (out / "rte" / "checkpoints" / f"step_{steps:08d}" / "COMPLETE").is_file()

    # 3. again: cola kept, rte resumed from its checkpoint, stsb trained; the whole table and average
    done = run_cli(*args, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/3] cola: completed earlier, kept" in done.stdout
    assert "[2/3] rte: stopped earlier; resuming" in done.stdout
    assert f"bert-mp finetune: resuming from step {steps}" in done.stdout
    assert (cola.stat().st_mtime_ns, cola.read_text()) == cola_written  # never trained again
    final = json.loads((out / "glue.json").read_text())
    assert [t["status"] for t in final["tasks"].values()] == ["completed"] * 3
    assert final["average_of"] == ["CoLA", "RTE", "STS-B"] and not final["complete"]
    assert "not the GLUE average" in done.stdout
