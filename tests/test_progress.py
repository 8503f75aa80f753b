"""Progress while training: steady-state s/step and time left on every step event and in the log line."""
from trainer import train_lora as train_lora_module
from trainer.train_lora import Pace, format_duration


def test_pace_leaves_the_first_step_out_and_follows_the_recent_window(monkeypatch):
    # marks as steps are reported: step 1's own time (warm-up, capture, compile) is before its mark and never
    # counted; here step 2 took 10 s, later ones 0.5 s
    clock = iter([0.0, 10.0, 10.5, 11.0, 11.5])
    monkeypatch.setattr(train_lora_module.time, "perf_counter", lambda: next(clock))
    pace = Pace()
    assert pace.seconds_per_step(1) is None  # nothing measured yet
    assert pace.seconds_per_step(2) == 10.0
    assert pace.seconds_per_step(3) == 5.25
    pace.marks = pace.marks[-1:]  # a full window moves on: only recent steps count
    assert pace.seconds_per_step(4) == 0.5


def test_pace_window_drops_old_steps(monkeypatch):
    times = iter(float(t) for t in range(1000))
    monkeypatch.setattr(train_lora_module.time, "perf_counter", lambda: next(times))
    pace = Pace()
    for step in range(1, 200):
        last = pace.seconds_per_step(step)
    assert len(pace.marks) == Pace.WINDOW and last == 1.0


def test_durations_read_like_a_clock():
    assert format_duration(59.6) == "1:00"
    assert format_duration(61) == "1:01"
    assert format_duration(3 * 3600 + 7 * 60 + 5) == "3:07:05"


def test_step_events_carry_s_per_step_and_time_left(adapter, dataset, tmp_path):
    from trainer.settings import LoraSettings, MemorySettings, TrainSettings
    events = []
    train_lora_module.train_lora(adapter, dataset, MemorySettings("no", False), LoraSettings(rank=4, alpha=4.0),
                                 TrainSettings(5, 1e-3, 0, "pace"), tmp_path, lambda **e: events.append(e),
                                 lambda: False)
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5]
    assert steps[0]["s_per_step"] is None and steps[0]["eta_s"] is None
    for event in steps[1:]:
        assert event["s_per_step"] > 0
        assert abs(event["eta_s"] - event["s_per_step"] * (5 - event["step"])) < 1e-9
    assert steps[-1]["eta_s"] == 0


def test_the_node_log_line_names_step_loss_pace_and_time_left():
    from helpers import node_module
    line = node_module("train").progress_line
    assert line({"step": 120, "total": 500, "loss": 0.10431, "s_per_step": 0.162, "eta_s": 61.6}) == \
        "step 120/500, loss 0.1043, 0.162 s/step, 1:02 left"
    assert line({"step": 1, "total": 500, "loss": 0.2, "s_per_step": None, "eta_s": None}) == "step 1/500, loss 0.2000"
