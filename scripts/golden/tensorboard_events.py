"""TensorBoard's own writer and reader on the scalars of three logged steps, for tests/it/tensorboard.rs.

Writes tests/golden/tensorboard/events.out.tfevents.1764979200.golden with TensorBoard's protobufs and
its RecordWriter (the TFRecord framing), then reads it back with TensorBoard's EventAccumulator into
scalars.json (beside the steps it wrote). The test writes the same values with k3mini's EventLog and insists on the same bytes,
and reads the file with k3mini's reader against scalars.json.

    python scripts/golden/tensorboard_events.py      # needs tensorboard only
"""
import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, SCALARS
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

OUT = Path(__file__).resolve().parents[2] / "tests" / "golden" / "tensorboard"
START = 1764979200.0
# (step, wall time after START, [(tag, value)]): a zero, a negative, float32's extremes, a
# per-layer expert load and an evaluation step, the kinds of figure a run logs.
STEPS = [
    (1, 0.5, [("train/loss", 10.375), ("train/lr", 3e-4), ("train/grad_norm", 0.0)]),
    (2, 1.25, [("train/loss", -2.5), ("train/lr", 1e-38), ("experts/layer0/load_min", 0.0),
               ("experts/layer0/load_max", 4096.0)]),
    (4, 2.75, [("train/loss", 3.4e38), ("eval/loss", 1 / 3), ("eval/top1", 0.625)]),
]

OUT.mkdir(parents=True, exist_ok=True)
path = OUT / f"events.out.tfevents.{int(START)}.golden"
with open(path, "wb") as f:
    w = RecordWriter(f)
    w.write(event_pb2.Event(wall_time=START, file_version="brain.Event:2").SerializeToString())
    for step, dt, values in STEPS:
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values])
        w.write(event_pb2.Event(wall_time=START + dt, step=step, summary=summary).SerializeToString())
    w.flush()

acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})
acc.Reload()
scalars = {
    tag: [[e.step, e.wall_time, e.value] for e in acc.Scalars(tag)]
    for tag in sorted(acc.Tags()["scalars"])
}
(OUT / "scalars.json").write_text(
    json.dumps({"start": START, "steps": [[s, START + dt, v] for s, dt, v in STEPS],
                "file_version": acc.file_version, "scalars": scalars}) + "\n")
print(f"wrote {path.name} ({path.stat().st_size} bytes) and scalars.json: {len(scalars)} tags")
