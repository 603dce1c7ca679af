"""scripts/demo_report.py (the table `make demo` prints) on synthetic worker reports.

The pool row of the teacher-forced table ("pool int2_S64_W256", 18 characters) overflowed the
16-character label column and shifted its numbers one column right of the other rows (newcomer
s7): every row's numbers must end where the header's column names end.
"""
import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "demo_report.py"
CONFIGS = ["bf16_S64_W256", "int2_S64_W256", "bf16_S16_W16", "int2_S16_W16"]


def tf(agreement, ppl, positions=208):
    return {"agreement": agreement, "ppl_ratio": ppl, "positions": positions}


def write_reports(out, pool_cfg=("int2", 64, 256)):
    tokens = [5, 6, 7]
    hp, s, w = pool_cfg
    evaluated = sorted(set(CONFIGS) | {f"{hp}_S{s}_W{w}"})
    ev = {
        "model": "stories260K-f32",
        "prompts": [{"name": "01_kite", "prompt_tokens": 447, "reference": {"text": "ref"},
                     "configs": {c: dict(tf(0.9, 1.1), greedy_tokens=tokens) for c in evaluated}}],
        "overall": {"bf16_S64_W256": tf(0.995, 0.9981), "int2_S64_W256": tf(0.865, 1.1125),
                    "bf16_S16_W16": tf(0.995, 0.998), "int2_S16_W16": tf(0.26, 35.7204)},
    }
    pre = {"prompts": [{"bytes_written": 276480}], "overall": {"bytes_written_per_token": 640.0}}
    dec = {
        "bf16_bytes_per_token": 640, "history_precision": hp, "sink_tokens": s,
        "recent_tokens": w, "page_size": 16,
        "prompts": [{"text": "pool", "tokens": tokens, "wanted_blocks": 27, "hit_blocks": 27,
                     "missed_blocks": 0, "loaded_blocks": 27, "bf16_blocks_fetched": 20,
                     "int2_blocks_fetched": 7, "recomputed_tokens": 15, "bytes_moved": 224640,
                     "bf16_bytes_equivalent": 276480, "bytes_stored": 282000, "fallback": False,
                     "fallback_reason": "", "teacher_forced": tf(0.865, 1.1125)}],
        "overall": {"hit_blocks": 27, "missed_blocks": 0, "loaded_blocks": 27, "fallbacks": 0,
                    "bytes_stored_per_token": 654.0, "bytes_moved_per_token": 520.0,
                    "moved_vs_bf16": 0.81, "teacher_forced": tf(0.865, 1.1125)},
    }
    for name, doc in (("eval", ev), ("prefill", pre), ("decode", dec)):
        (out / f"{name}.json").write_text(json.dumps(doc))


def table(stdout):
    lines = stdout.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("== teacher-forced"))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def value_ends(row, label):
    """End offsets of the three values that follow `label` in `row`."""
    ends, at = [], row.index(label) + len(label)
    for value in row[at:].split():
        at = row.index(value, at) + len(value)
        ends.append(at)
    return ends


def test_teacher_forced_table_rows_line_up_with_the_header(tmp_path):
    for pool_cfg in (("int2", 64, 256), ("bf16", 16, 16), ("int2", 1024, 4096)):
        write_reports(tmp_path, pool_cfg)
        run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), '{"eval": 1.0}'],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        rows = table(run.stdout)
        label = "pool %s_S%d_W%d" % pool_cfg
        assert [r.split()[0] for r in rows] == ["config"] + CONFIGS + ["pool"], rows
        assert label in rows[-1], rows
        header = rows[0]
        want = [header.index(h) + len(h) for h in ("agreement", "ppl ratio", "positions")]
        for row, name in zip(rows[1:], CONFIGS + [label]):
            ends = value_ends(row, name)
            assert ends == want, f"{row!r} ends its columns at {ends}, the header at {want}"
        # The label column holds the longest label with a space to spare.
        assert rows[-1].index(label) + len(label) < want[0] - len("agreement"), rows[-1]
