"""GPU probe: does the opaque weight cast op explain compiled tensorwise's gap to torchao?
fk: float8kit as is; fk_noop: cast.fused_cast_applies refuses under compile (inductor owns
the weight's cast); ao: torchao. One process, interleaved rounds, both timings."""
import copy, json, os, statistics, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from torch import nn
import common
import float8kit
import float8kit.cast as C

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")]
iters = int(os.environ.get("ITERS", "50"))
ao, _ = common.import_torchao_float8()
out = []
orig = C.fused_cast_applies
noop = lambda hp, *a, **k: False if C.versions.compiling() else orig(hp, *a, **k)
for M, K, N in shapes:
    torch.manual_seed(0)
    base = nn.Linear(K, N, bias=False).to(dev, torch.bfloat16)
    mods = {"bf16": base,
            "fk": float8kit.convert_to_float8_training(copy.deepcopy(base), config=common.float8kit_config("tensorwise")),
            "fk_noop": float8kit.convert_to_float8_training(copy.deepcopy(base), config=common.float8kit_config("tensorwise")),
            "ao": ao.convert_to_float8_training(copy.deepcopy(base), config=common.torchao_recipe_config(ao, "tensorwise"))}
    xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    gos = [torch.randn(M, N, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    # distinct code objects: each variant its own dynamo cache (fk_noop traced while patched)
    def s_bf16(x, m=mods["bf16"]): return m(x)
    def s_fk(x, m=mods["fk"]): return m(x)
    def s_noop(x, m=mods["fk_noop"]): return m(x)
    def s_ao(x, m=mods["ao"]): return m(x)
    steps = {"bf16": torch.compile(s_bf16), "fk": torch.compile(s_fk), "fk_noop": torch.compile(s_noop), "ao": torch.compile(s_ao)}
    def run(name, i):
        x = xs[i % 2]
        steps[name](x).backward(gos[i % 2])
        x.grad = None
        for p in mods[name].parameters(): p.grad = None
    for name in steps:
        C.fused_cast_applies = noop if name == "fk_noop" else orig
        for i in range(3): run(name, i)
    C.fused_cast_applies = orig
    res = {(n, t): [] for n in steps for t in ("b2b", "sync")}
    for r in range(int(os.environ.get("ROUNDS", "5"))):
        for n in steps:
            for t in ("b2b", "sync"):
                res[(n, t)].append(common.median(common.time_ms(lambda i, n=n: run(n, i), dev, warmup=5, iters=iters, synced=t == "sync")))
    row = {"M": M, "K": K, "N": N}
    for (n, t), v in res.items():
        row[f"{n}_{t}_ms"] = round(statistics.median(v), 4)
    for t in ("b2b", "sync"):
        for n in ("fk", "fk_noop"):
            row[f"{n}_vs_ao_{t}"] = round(statistics.median([a / b for a, b in zip(res[("ao", t)], res[(n, t)])]), 3)
            row[f"{n}_vs_bf16_{t}"] = round(statistics.median([a / b for a, b in zip(res[("bf16", t)], res[(n, t)])]), 3)
    # same bits with and without the op (the weight's cast moves no bit)
    outs = {}
    for n in ("fk", "fk_noop"):
        x = xs[0].detach().clone().requires_grad_(True)
        y = steps[n](x); y.backward(gos[0])
        outs[n] = (y.detach(), x.grad.detach(), mods[n].weight.grad.detach())
        x.grad = None; mods[n].weight.grad = None
    row["noop_bitwise"] = all(torch.equal(a, b) for a, b in zip(outs["fk"], outs["fk_noop"]))
    print(json.dumps(row), flush=True)
    out.append(row)
info = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "rows": out}
json.dump(info, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
