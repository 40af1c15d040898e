"""Float8Monitor: per-layer SQNR, saturation and underflow on sampled steps, checked against
independent fp32 measurements; the guardrail's hp fallback; free unsampled steps."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import OpCounter
from benchmarks.measures.monitor import DIM, MLP, drift_case, drift_model, train
from float8kit import (
    Float8LinearConfig,
    Float8Monitor,
    convert_to_float8_training,
)
from tests.helpers import sqnr


def test_drift_names_the_static_layer_and_the_guardrail_switches_only_it(tmp_path):
    case = drift_case(tmp_path / "m.jsonl")
    rows = case["report"]
    assert {r["step"] for r in rows} == {2}
    assert len(rows) == 9  # 3 layers x 3 gemms
    worst = min(rows, key=lambda r: r["sqnr_db"])
    assert (worst["layer"], worst["gemm"]) == ("fc1", "output")
    assert worst["sqnr_db"] < 10
    assert worst["saturated"] > 0.01
    assert worst["operands"]["input"]["saturated"] > 0.01
    others = [r for r in rows if r["layer"] != "fc1" and r["gemm"] == "output"]
    for r in others:
        assert 24 < r["sqnr_db"] < 31, r
        assert r["saturated"] == 0
    # the log holds both sampled steps (0 and 2), one JSON object per row
    lines = [json.loads(s) for s in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0] * 9 + [2] * 9
    assert lines[9:] == [{**r, "sqnr_db": r["sqnr_db"]} for r in rows]

    # the guardrail: exactly fc1 falls back, once, with a warning naming it
    msgs = case["warnings"]
    assert len(msgs) == 1 and "'fc1'" in msgs[0] and "step 0" in msgs[0]
    assert [(f["layer"], f["step"]) for f in case["fallbacks"]] == [("fc1", 0)]
    assert case["fallbacks"][0]["sqnr_db"] < 10
    fc1 = {r["gemm"]: r for r in case["guarded_report"] if r["layer"] == "fc1"}
    assert fc1["output"]["fallback"] and fc1["output"]["sqnr_db"] > 40
    assert not any(r["fallback"] for r in case["guarded_report"] if r["layer"] != "fc1")
    # and independently: fc1's output now is F.linear's, while its float8 path still fails
    assert case["fc1_independent_db"] > 40
    assert case["fc1_float8_db"] < 10


def test_monitor_sqnr_equals_independent_fp32_measurement():
    model = drift_model()
    monitor = Float8Monitor(model, every=1)
    seen = {}

    def keep(name):
        def fwd(mod, args, out):
            seen[name] = {"input": args[0].detach(), "output": out.detach()}

        def bwd(mod, grad_input, grad_output):
            seen[name].update(grad_input=grad_input[0], grad_output=grad_output[0])

        return fwd, bwd

    for name in ("fc1", "fc2", "fc3"):
        fwd, bwd = keep(name)
        getattr(model, name).register_forward_hook(fwd)
        getattr(model, name).register_full_backward_hook(bwd)
    x = torch.randn(64, DIM).requires_grad_()
    model(x).square().mean().backward()
    rows = {(r["layer"], r["gemm"]): r["sqnr_db"] for r in monitor.report()}
    for name in ("fc1", "fc2", "fc3"):
        mod, s = getattr(model, name), seen[name]
        w, inp, go = mod.weight.double(), s["input"].double(), s["grad_output"].double()
        independent = {
            "output": sqnr(F.linear(inp, w, mod.bias.double()), s["output"]),
            "grad_input": sqnr(go @ w, s["grad_input"]),
            "grad_weight": sqnr(go.t() @ inp, mod.weight.grad),
        }
        for gemm, db in independent.items():
            assert 20 < db < 40, (name, gemm, db)  # float8, not a trivial comparison
            assert abs(rows[(name, gemm)] - db) < 1, (name, gemm, rows[(name, gemm)], db)


def test_autocast_reference_stays_fp32_and_eval_forwards_are_not_steps():
    model = drift_model()
    monitor = Float8Monitor(model, every=2)
    seen = {}

    def keep_first(mod, args, out):
        if not seen:
            seen.update(x=args[0], out=out)

    model.fc2.register_forward_hook(keep_first)
    x = torch.randn(64, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().square().mean().backward()
    model.eval()
    with torch.no_grad():
        model(x)  # not a step
    model.train()
    assert monitor.step == 0
    rows = {r["gemm"]: r for r in monitor.report() if r["layer"] == "fc2"}
    ref = F.linear(seen["x"].float(), model.fc2.weight.float(), model.fc2.bias.float())
    independent = sqnr(ref, seen["out"])
    assert seen["out"].dtype == torch.bfloat16 and 20 < independent < 35
    assert abs(rows["output"]["sqnr_db"] - independent) < 1
    assert set(rows) == {"output", "grad_input", "grad_weight"}


def _count_ops(fn) -> dict:
    with OpCounter() as counter:
        fn()
    return dict(counter.counts)


def test_unsampled_steps_run_no_extra_op():
    torch.manual_seed(1)
    model = drift_model()
    x = torch.randn(32, DIM)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    bare = _count_ops(step)
    monitor = Float8Monitor(model, every=3)
    sampled = _count_ops(step)  # step 0
    unsampled = _count_ops(step)  # step 1
    assert unsampled == bare
    assert "aten._local_scalar_dense.default" not in unsampled
    # the sampled step runs the fp32 gemms: 3 layers x 3 gemms more mm/addmm
    mm = ("aten.mm.default", "aten.addmm.default")
    assert sum(sampled.get(k, 0) for k in mm) >= sum(bare.get(k, 0) for k in mm) + 9
    assert monitor.report()[0]["step"] == 0


def test_fallback_survives_a_checkpoint_through_the_monitor_state_dict():
    model = drift_model()
    monitor = Float8Monitor(model, every=1, fallback_below_db=15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, 1)
    saved = {"model": model.state_dict(), "monitor": monitor.state_dict()}
    assert set(saved["model"]) == set(drift_model().state_dict())  # keys unchanged

    resumed = drift_model()
    resumed.load_state_dict(saved["model"])
    monitor2 = Float8Monitor(resumed, every=1, fallback_below_db=15)
    monitor2.load_state_dict(saved["monitor"])
    assert monitor2.fallbacks == monitor.fallbacks and monitor2.step == monitor.step
    x = torch.randn(16, DIM) * 100
    torch.testing.assert_close(resumed(x), model(x), rtol=0, atol=0)
    ref = F.linear(x.double(), resumed.fc1.weight.double(), resumed.fc1.bias.double())
    assert sqnr(ref, resumed.fc1(x)) > 40


def test_fallback_on_any_gemm_also_watches_the_backward():
    # unit-scale data: outputs sit near 28.5-30.5 dB, grad_inputs (e5m2) near 25.5-26.5 dB
    result = {}
    for on in ("output", "any"):
        torch.manual_seed(0)
        model = drift_model()
        monitor = Float8Monitor(model, every=1, fallback_below_db=27.5, fallback_on=on)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.randn(64, DIM)).square().mean().backward()
        rows = {(r["layer"], r["gemm"]): r["sqnr_db"] for r in monitor.report()}
        result[on] = (rows, [(f["layer"], f["gemm"]) for f in monitor.fallbacks])
    rows, switched = result["output"]
    assert min(db for (_, g), db in rows.items() if g == "output") > 27.5 and switched == []
    rows, switched = result["any"]
    low = [key for key, db in rows.items() if db < 27.5]
    assert low and all(g != "output" for _, g in low)
    # each layer switched once, by its first gemm below the floor
    first_low = {}
    for layer, g in low:
        first_low.setdefault(layer, (layer, g))
    assert switched == list(first_low.values())


def test_nan_sqnr_ranks_worst_and_trips_the_guardrail():
    # fc3's weight holds a NaN: its output rows are NaN, fc1's and fc2's stay finite
    torch.manual_seed(0)
    x = torch.randn(64, DIM)
    for floor in (None, 15):
        model = drift_model()
        with torch.no_grad():
            model.fc3.weight[0, 0] = float("nan")
        monitor = Float8Monitor(model, every=1, fallback_below_db=floor)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(x)  # a train-mode forward: a sampled step, output rows only
        rows = {r["layer"]: r["sqnr_db"] for r in monitor.report()}
        assert math.isnan(rows["fc3"]) and 20 < rows["fc1"] < 40 and 20 < rows["fc2"] < 40
        assert [r["layer"] for r in monitor.worst(3)] == [
            "fc3",
            *sorted(["fc1", "fc2"], key=rows.get),
        ]
        assert [r["layer"] for r in monitor.worst(1, gemm="output")] == ["fc3"]
    # the floor: exactly fc3, with a warning naming it
    assert [(f["layer"], f["step"]) for f in monitor.fallbacks] == [("fc3", 0)]
    msgs = [str(w.message) for w in caught if "Float8Monitor" in str(w.message)]
    assert len(msgs) == 1 and "'fc3'" in msgs[0] and "nan dB" in msgs[0]


def test_sqnr_db_of_non_finite_powers():
    from float8kit.monitor import _sqnr_db

    assert _sqnr_db(100.0, 1.0) == 20.0
    assert _sqnr_db(1.0, 0.0) == _sqnr_db(0.0, 0.0) == math.inf  # exact
    assert _sqnr_db(0.0, 1.0) == _sqnr_db(1.0, math.inf) == -math.inf  # was a math error
    for signal, noise in ((math.nan, 1.0), (1.0, math.nan), (math.inf, math.inf)):
        assert math.isnan(_sqnr_db(signal, noise))


def test_argument_errors_name_the_fix():
    with pytest.raises(ValueError, match="every=0"):
        Float8Monitor(drift_model(), every=0)
    with pytest.raises(ValueError, match="no Float8Linear"):
        Float8Monitor(MLP())
    with pytest.raises(ValueError, match="fallback_on"):
        Float8Monitor(drift_model(), fallback_on="grad")
    for bad in (float("nan"), float("inf"), True, "15"):
        with pytest.raises(ValueError, match=r"fallback_below_db=.* finite number"):
            Float8Monitor(drift_model(), fallback_below_db=bad)
    model = convert_to_float8_training(
        MLP(), config=Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    )
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather=False"):
        Float8Monitor(model)


# ---------------------------------------------------------------------------- FSDP2, 2 ranks


def _worker_fsdp(rank: int, world: int, tmp: str) -> dict:
    """Every rank: the drift model under FSDP2 (each layer and the root sharded), its own
    data, the guardrail on; counts the monitor's collectives."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = drift_model()  # the same weights and calibration on every rank
    for name in ("fc1", "fc2", "fc3"):
        fully_shard(getattr(model, name))
    fully_shard(model)
    monitor = Float8Monitor(model, every=2, fallback_below_db=15)
    calls, real = [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    torch.manual_seed(100 + rank)
    xs = [torch.randn(32, DIM) * 100 for _ in range(5)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in xs:
            model(x).square().mean().backward()
            model.zero_grad()
    dist.all_reduce = real
    # the same run with the monitor attached before fully_shard
    torch.manual_seed(0)
    model = drift_model()
    before = Float8Monitor(model, every=2, fallback_below_db=15)
    for name in ("fc1", "fc2", "fc3"):
        fully_shard(getattr(model, name))
    fully_shard(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in xs:
            model(x).square().mean().backward()
            model.zero_grad()
    return {
        "rows_attached_before": before.report(all_steps=True),
        "rows": monitor.report(all_steps=True),
        "fallbacks": monitor.fallbacks,
        "all_reduces": len(calls),
        "warnings": [str(w.message) for w in caught if "Float8Monitor" in str(w.message)],
        "xs": xs,
    }


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    from benchmarks.measures.gloo import spawn

    return spawn("tests.test_monitor:_worker_fsdp", 2, tmp_path_factory.mktemp("monitor_fsdp2"))


def test_fsdp2_ranks_agree_and_fall_back_together(fsdp2):
    r0, r1 = fsdp2
    assert r0["rows"] == r1["rows"]  # one reduction: every rank reports the same numbers
    assert r0["rows_attached_before"] == r0["rows"]  # before or after fully_shard: the same
    assert r0["fallbacks"] == r1["fallbacks"]
    assert [(f["layer"], f["step"]) for f in r0["fallbacks"]] == [("fc1", 0)]
    assert len(r0["warnings"]) == len(r1["warnings"]) == 1
    assert r0["all_reduces"] == r1["all_reduces"] == 3  # sampled steps 0, 2, 4
    # the reduced step-0 numbers are the whole batch's: one device on both ranks' tokens
    torch.manual_seed(0)
    model = drift_model()
    monitor = Float8Monitor(model, every=2)
    with torch.no_grad():
        model(torch.cat([r0["xs"][0], r1["xs"][0]]))
    single = {r["layer"]: r for r in monitor.report()}
    sharded = {r["layer"]: r for r in r0["rows"] if r["step"] == 0 and r["gemm"] == "output"}
    # fc1 (static input scale, same weight): bitwise the same casts, so the same sums
    assert sharded["fc1"]["sqnr_db"] == pytest.approx(single["fc1"]["sqnr_db"], abs=1e-6)
    assert sharded["fc1"]["saturated"] == single["fc1"]["saturated"] > 0.01
    for name in ("fc2", "fc3"):  # dynamic per-rank scales: close, not equal
        assert abs(sharded[name]["sqnr_db"] - single[name]["sqnr_db"]) < 1
    # after the switch fc1 reports its (hp) output only
    after = [r for r in r0["rows"] if r["layer"] == "fc1" and r["step"] == 4]
    assert [(r["gemm"], r["fallback"]) for r in after] == [("output", True)]
    assert after[0]["sqnr_db"] > 40


# ---------------------------------------------------------------------------- torch.compile


def test_attach_after_compile_measures_eagerly_and_compiles_the_rest():
    import torch._dynamo

    torch._dynamo.reset()
    xs = [torch.randn(64, DIM) for _ in range(3)]
    rows = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = drift_model()
        if mode == "compiled":
            model = torch.compile(model)
        monitor = Float8Monitor(model, every=2)
        torch._dynamo.utils.counters.clear()
        for x in xs:
            model(x).square().mean().backward()
        rows[mode] = monitor.report()
        if mode == "compiled":
            counters = torch._dynamo.utils.counters
            assert not counters["graph_break"]  # step 1 ran one graph, no break
            assert counters["stats"]["unique_graphs"] == 1
    assert len(rows["compiled"]) == 9 and all(r["step"] == 2 for r in rows["compiled"])
    # sampled steps run eagerly: the same numbers as an eager run's
    assert [r["sqnr_db"] for r in rows["compiled"]] == [r["sqnr_db"] for r in rows["eager"]]


def _compile_and_train(xs, how: str, backend: str, monitor: bool):
    """The drift model compiled ``how`` ("module": torch.compile(model); "fn": a compiled
    function that calls it), the monitor (when asked) attached to the model before
    compiling; trains on ``xs``. Returns the monitor."""
    torch.manual_seed(0)
    model = drift_model()
    mon = Float8Monitor(model, every=2) if monitor else None
    if how == "module":
        run = torch.compile(model, backend=backend)
    else:
        run = torch.compile(lambda x: model(x), backend=backend)
    for x in xs:
        run(x).square().mean().backward()
    return mon


@pytest.mark.parametrize("how, backend", [("module", "inductor"), ("fn", "eager")])
def test_attach_before_compile_measures_like_eager_also_after_another_model(how, backend):
    import torch._dynamo

    xs = [torch.randn(64, DIM) for _ in range(3)]
    torch.manual_seed(0)
    model = drift_model()
    eager = Float8Monitor(model, every=2)
    for x in xs:
        model(x).square().mean().backward()
    ref = [(r["layer"], r["gemm"], r["sqnr_db"]) for r in eager.report()]
    assert len(ref) == 9

    def rows(mon):
        assert mon.step == 2
        return [(r["layer"], r["gemm"], r["sqnr_db"]) for r in mon.report()]

    def close(got):
        if backend == "eager":
            return got  # the same ops as eager: the same numbers
        # inductor's gelu and loss backward round grad_output differently in fp32, which
        # moves a float8 rounding here and there: a few thousandths of a dB
        return [(layer, g, pytest.approx(db, abs=0.05)) for layer, g, db in got]

    torch._dynamo.reset()  # as in a fresh process
    assert close(rows(_compile_and_train(xs, how, backend, monitor=True))) == ref
    assert torch._dynamo.eval_frame._stance.stance == "default"  # not left forcing eager
    # a second model of the same architecture, after one compiled without a monitor: the
    # graph compiled for the first must not run the second with the monitor's hooks skipped
    torch._dynamo.reset()
    _compile_and_train(xs, how, backend, monitor=False)
    assert close(rows(_compile_and_train(xs, how, backend, monitor=True))) == ref


def test_remove_restores_the_layer_classes():
    model = drift_model()
    classes = [type(m) for m in (model.fc1, model.fc2, model.fc3)]
    monitor = Float8Monitor(model, every=1, fallback_below_db=15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, 1)
    assert [f["layer"] for f in monitor.fallbacks] == ["fc1"]
    monitor.remove()
    assert [type(m) for m in (model.fc2, model.fc3)] == classes[1:]
    # fc1 stays switched to hp: the hp forward in front of its own class, nothing else
    assert type(model.fc1).__mro__[2:] == classes[0].__mro__
    x = torch.randn(16, DIM) * 100
    torch.testing.assert_close(model.fc1(x), F.linear(x, model.fc1.weight, model.fc1.bias))


# ---------------------------------------------------------------------------- recipes/train.py


def test_train_monitor_flag_writes_the_table_and_changes_no_loss(tmp_path):
    from tests.helpers import run_train

    torch.set_num_threads(1)
    flags = ["--float8", "tensorwise", "--steps", "4", "--eval-every", "0"]
    plain = run_train(tmp_path / "plain", *flags)
    monitored = run_train(tmp_path / "mon", *flags, "--monitor", "2")
    assert [r["loss"] for r in monitored] == [r["loss"] for r in plain]  # measures only
    rows = [json.loads(s) for s in (tmp_path / "mon" / "monitor.jsonl").read_text().splitlines()]
    steps = sorted({r["step"] for r in rows})
    assert steps == [2, 4]  # metrics.jsonl's step numbers
    per_step = len(rows) // 2
    layers = {r["layer"] for r in rows}
    assert per_step == 3 * len(layers) and "output" not in layers  # the hp head is not float8
    for r in rows:
        assert 15 < r["sqnr_db"] < 60 and r["saturated"] == 0, r  # float8, not exact
    # compare.py's per-layer plot draws the last sampled step's rows
    import compare

    series = compare.plot_monitor(tmp_path, ["plain", "mon"], tmp_path / "monitor.png")
    assert list(series) == ["mon"]
    last = [r for r in rows if r["step"] == 4]
    for gemm, pts in series["mon"].items():
        assert pts == [(r["layer"], r["sqnr_db"]) for r in last if r["gemm"] == gemm]
    assert (tmp_path / "monitor.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------- overhead


def test_mxfp8_layers_report_independent_sqnr_and_rceil_saturates_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("mxfp8"))
    monitor = Float8Monitor(model, every=1)
    x = torch.randn(96, 64) * torch.logspace(-2, 2, 64)  # six decades of column scales
    out = model(x)
    out.square().mean().backward()
    rows = {(r["layer"], r["gemm"]): r for r in monitor.report()}
    assert len(rows) == 6
    first = model[0]
    ref = F.linear(x.double(), first.weight.double(), first.bias.double())
    want = sqnr(ref, first(x).detach())
    assert 20 < want < 40
    assert abs(rows[("0", "output")]["sqnr_db"] - want) < 1
    for r in rows.values():
        assert r["saturated"] == 0, r  # RCEIL rounds every block's scale up: nothing clamps
        assert 20 < r["sqnr_db"] < 40, r
