"""Memory traffic float8 adds around the gemms of one compiled Linear, read from inductor.

For each recipe (float8kit's, torchao.float8's counterparts, bf16) this compiles forward +
backward of one bias-free ``nn.Linear(K, N)`` on an (M, K) bf16 input and records, from
inductor's own scheduler, every kernel of the forward and backward graphs: its kind
(generated, or an extern call such as a gemm) and the bytes it reads and writes
(``BaseSchedulerNode.get_read_write_buffers_sizes``: per buffer the smaller of the
buffer's size and the elements the kernel's loops touch, times the dtype's size; the
number Triton's ``num_bytes_accessed`` metric sums, which stays 0 on CPU). A row's
``bytes`` and ``kernels`` count what runs *outside the gemms* (amax reductions, casts,
layout copies, scale math); the gemms' own operand bytes go to ``gemm_bytes``.

The count is a property of the compiled graph and of the backend that fuses it:
``--device cpu`` (the default) counts inductor's C++ kernels, ``--device cuda`` its Triton
kernels on a GPU (benchmarks/results/ holds such runs). float8kit's own opaque ops count
their operands: ``float8kit::cast_tensorwise`` reads the hp operand once and writes each
float8 layout it is asked for, which is what its CUDA kernel moves (on CPU its torch
reference runs, with more passes: CPU is not where speed is measured). On CPU float8kit's
gemm is its custom op ``float8kit::cpu_scaled_mm`` (torch._scaled_mm on CUDA, same
operands); the blockwise gemm, which CPU only emulates in fp32, is replaced for the CPU
count by an opaque op that takes the operands the CUDA kernel takes
(``float8kit.gemm._kernel_block_mm``'s layout and padding code runs, only the kernel is
stubbed).

``eager_passes`` (rows at a shape whose M*K, K*N and M*N differ): the kernels one eager
fwd+bwd runs over each operand outside the gemms (``eager_passes``: the profiler's
innermost data-moving ops that read an operand-sized tensor, float8kit's ops as one each).

``minimum`` rows are the least traffic each recipe's math needs with no producer fusion
(the operand arrives in memory in bf16), from ``minimum_bytes``; docs/performance.md
justifies each. A row measured at a shape proportional to the torchao.float8 README's
4096x8192x16384 (each dim /16, so each of the MK, KN, MN terms is /256) is also written
scaled to that shape (``bytes * 256``, ``scaled_from`` names the measured shape): the
traffic is a sum of per-element passes over the three operands, so it scales exactly with
them, apart from a few bytes of scale math.

    python benchmarks/bench_traffic.py --json numbers/traffic.json
    python benchmarks/bench_traffic.py --shapes 256x512x1024 --recipes tensorwise,delayed -v
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import common
import torch
import torch._inductor.config as inductor_config
from torch import nn

# ----------------------------------------------------------------------------
# which kernels are gemms

# Extern calls that are the layer's gemms (bf16 mm, float8 gemms); anything else extern
# (a fallback op) counts as traffic outside the gemms.
GEMM_OPS = (
    "extern_kernels.mm",
    "extern_kernels.addmm",
    "extern_kernels.bmm",
    "aten.mm",
    "aten._scaled_mm",
    "extern_kernels._scaled_mm",
    "extern_kernels.scaled_mm",
    "float8kit.cpu_scaled_mm",
    "bench_traffic.block_scaled_mm",
)

SEED_SHAPE = (4096, 8192, 16384)  # the torchao.float8 README's largest layer


def _kernel_name(snode) -> str:
    node = getattr(snode, "node", None)
    for attr in ("python_kernel_name", "op_overload"):
        name = getattr(node, attr, None)
        if name:
            return str(name)
    return type(node).__name__


def _numel(name: str) -> int | None:
    from torch._inductor.virtualized import V

    buf = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
    try:
        size = buf.get_size()
    except (AttributeError, NotImplementedError):  # a multi-output extern's tuple
        return None
    return int(V.graph.sizevars.optimization_hint(sympy_product(size), fallback=0))


def _outputs(node) -> list[tuple[int, int]]:
    """(numel, bytes) of each output of a multi-output extern call (its ``MultiOutput``
    views, which run nothing), for the writes its tuple buffer stands for."""
    from torch._inductor.virtualized import V

    got = []
    for out in getattr(node, "outputs", None) or []:
        try:
            numel = int(
                V.graph.sizevars.optimization_hint(sympy_product(out.get_size()), fallback=0)
            )
        except (AttributeError, NotImplementedError):
            continue
        got.append((numel, numel * out.get_dtype().itemsize))
    return got


def sympy_product(xs):
    from torch._inductor.utils import sympy_product as prod

    return prod(xs)


def kernel_record(snode) -> dict | None:
    """One scheduler node as ``{kind, name, bytes, gemm, by_numel}``; None for nodes that
    run nothing (no-ops, the views a multi-output extern call unpacks). ``by_numel`` splits
    the bytes by the element count of the buffer moved (which operand it is, when M*K, K*N
    and M*N differ)."""
    from torch._inductor import ir
    from torch._inductor import scheduler as sched

    if isinstance(snode, sched.NopKernelSchedulerNode):
        return None
    if isinstance(snode, sched.ExternKernelSchedulerNode) and isinstance(
        snode.node, ir.MultiOutput
    ):
        return None
    by_numel: dict[int, int] = {}
    accesses = snode.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
    for buf, nbytes in accesses.items():
        key = _numel(buf)
        if key is None:  # a multi-output extern call writes its outputs: split by output
            for size, out_bytes in _outputs(snode.node):
                by_numel[size] = by_numel.get(size, 0) + out_bytes
                nbytes -= out_bytes
            key = 0
        by_numel[key] = by_numel.get(key, 0) + nbytes
    record = {"bytes": snode.get_read_write_buffers_sizes(), "by_numel": by_numel}
    if isinstance(snode, sched.ExternKernelSchedulerNode):
        name = _kernel_name(snode)
        gemm = any(g in name.replace("::", ".").replace("torch.ops.", "") for g in GEMM_OPS)
        return {"kind": "extern", "name": name, "gemm": gemm, **record}
    return {"kind": "generated", "name": snode.get_name(), "gemm": False, **record}


@contextlib.contextmanager
def record_kernels():
    """Yields a list that gets, per graph inductor compiles while the context is active, the
    list of its kernels (``kernel_record``), read just before code generation (after
    fusion: one record per kernel that will run)."""
    from torch._inductor import scheduler as sched

    graphs: list[list[dict]] = []
    real = sched.Scheduler.codegen

    def codegen(self):
        graphs.append([r for r in map(kernel_record, self.nodes) if r is not None])
        return real(self)

    sched.Scheduler.codegen = codegen
    try:
        yield graphs
    finally:
        sched.Scheduler.codegen = real


def summarize(graphs: list[list[dict]], m: int, k: int, n: int) -> dict:
    """``bytes`` and ``kernels`` outside the gemms, ``gemm_bytes`` and ``gemms``, and
    ``per_element``: the bytes outside the gemms per element of input (M*K), weight (K*N)
    and grad_output (M*N), from the buffers of those sizes (None unless the three differ;
    the rest, scale math, is ``other_bytes``)."""
    ks = [k for g in graphs for k in g]
    per_element, other = None, None
    sizes = {"input": m * k, "weight": k * n, "grad_output": m * n}
    if len(set(sizes.values())) == 3:
        moved = {}
        for kr in ks:
            if not kr["gemm"]:
                for numel, b in kr["by_numel"].items():
                    moved[numel] = moved.get(numel, 0) + b
        per_element = {op: round(moved.pop(e, 0) / e, 4) for op, e in sizes.items()}
        other = sum(moved.values())
    return {
        "per_element": per_element,
        "other_bytes": other,
        "bytes": sum(k["bytes"] for k in ks if not k["gemm"]),
        "kernels": sum(1 for k in ks if not k["gemm"]),
        "gemm_bytes": sum(k["bytes"] for k in ks if k["gemm"]),
        "gemms": sum(1 for k in ks if k["gemm"]),
        "graphs": len(graphs),
    }


# ----------------------------------------------------------------------------
# the blockwise gemm as CUDA runs it, opaque


@torch.library.custom_op("bench_traffic::block_scaled_mm", mutates_args=())
def _block_gemm_stub(
    a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor
) -> torch.Tensor:
    return a.new_zeros((a.size(0), b.size(1)), dtype=torch.bfloat16)


@_block_gemm_stub.register_fake
def _(a, b, inv_a, inv_b):
    return a.new_empty((a.size(0), b.size(1)), dtype=torch.bfloat16)


@contextlib.contextmanager
def cuda_block_gemm_path():
    """float8kit's blockwise gemm takes its CUDA path (layouts, padding, scale layouts) with
    the kernel replaced by an opaque stub: the count sees what a GPU run moves."""
    import types

    import float8kit.gemm as g
    from float8kit.formats import Blockwise

    real_emulated, real_f = Blockwise.emulated_mm, g.F

    def kernel_path(self, a, b):  # in place of the format's fp32 emulation
        inv_a = a._scale.to(torch.float32).reciprocal()
        inv_b = b._scale.to(torch.float32).reciprocal()
        return g._kernel_block_mm(
            a._data, b._data, inv_a, inv_b, a._gran.block, b._gran.block, None
        )

    def scaled_mm(a, b, inv_a, _ra, inv_b, _rb, output_dtype):
        return _block_gemm_stub(a, b, inv_a, inv_b)

    Blockwise.emulated_mm = kernel_path
    g.F = types.SimpleNamespace(scaled_mm=scaled_mm, ScalingType=real_f.ScalingType, pad=real_f.pad)
    try:
        yield
    finally:
        Blockwise.emulated_mm, g.F = real_emulated, real_f


# ----------------------------------------------------------------------------
# the minimum each recipe's math needs


def minimum_bytes(recipe: str, m: int, k: int, n: int) -> int:
    """Least bytes read+written outside the gemms by one fwd+bwd of an (M, K) x (K, N) bf16
    layer, with the operands in memory in bf16 (no producer fusion). Per operand element:
    2 B per read of the bf16 value, 1 B per fp8 layout written; the gemms take A row-major
    and B column-major, so an operand that two gemms use with different major-ness needs
    two fp8 layouts (input: output gemm's A and grad_weight's B; weight: output's B and
    grad_input's B transposed; grad_output: grad_input's A and grad_weight's A transposed).

    - a scale that needs the whole tensor (dynamic tensorwise) needs its own amax pass
      before the cast: 2 + 2 + layouts.
    - a scale local to a slice the casting pass holds (a row, a column tile, a 1x128 tile,
      a 128x128 block) gets its amax in that pass: 2 + layouts per distinct cast. rowwise
      casts each operand twice (row scales for one gemm, column scales for the other),
      each cast one layout: 2 + 1 + 2 + 1.
      blockwise's two activation casts (1x128 tiles for one gemm, 128x1 for the other)
      are both local to one 128x128 region: one read writes both, 2 + 1 + 1.
    - delayed, static: the scale is known before the cast; delayed's amax record rides in
      the cast pass: 2 + layouts.
    - hp gemms (bf16, the grad_weight of rowwise_with_gw_hp) read the bf16 operand in place.
    Scale math (a few scalars or M + N floats) is not counted.
    """
    mk, kn, mn = m * k, k * n, m * n
    if recipe == "bf16":
        return 0
    if recipe in ("tensorwise", "rowwise"):
        return 6 * (mk + kn + mn)
    if recipe in ("delayed", "static", "blockwise"):
        return 4 * (mk + kn + mn)
    if recipe == "rowwise_with_gw_hp":
        # input and grad_output: one row-scaled cast each (2 + 1); weight: a row-scaled cast
        # (output gemm) and a tensorwise one (grad_input), whose amax the row pass also
        # finds (the max of the row amaxes): 2 + 1 + 2 + 1
        return 3 * mk + 6 * kn + 3 * mn
    raise ValueError(f"minimum_bytes: no minimum defined for recipe {recipe!r}")


# ----------------------------------------------------------------------------
# layers


FLOAT8KIT_RECIPES = [
    "tensorwise",
    "delayed",
    "static",
    "rowwise",
    "rowwise_with_gw_hp",
    "blockwise",
]
TORCHAO_RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def make_layer(impl: str, recipe: str, k: int, n: int, ao_float8=None) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    if recipe == "bf16":
        return layer
    if impl == "float8kit":
        import float8kit

        return float8kit.convert_to_float8_training(
            layer, config=common.float8kit_config(recipe), module_filter_fn=lambda mod, fqn: True
        )
    cfg = common.torchao_recipe_config(ao_float8, recipe)
    return ao_float8.convert_to_float8_training(
        layer, config=cfg, module_filter_fn=lambda mod, fqn: True
    )


def steady_layer(
    impl: str, recipe: str, m: int, k: int, n: int, ao_float8=None, device: str = "cpu"
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """One layer (``make_layer``) on ``device`` in its steady state, an input and a
    grad_output: for delayed, an eager step records amaxes and precompute_scales sets the
    scales (before that a delayed cast is a dynamic one); on CUDA the host learns that they
    are set at the next precompute_scales, once the device has written them."""
    layer = make_layer(impl, recipe, k, n, ao_float8).to(device)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    go = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    if recipe == "delayed":
        import float8kit

        for _ in range(2):
            layer(x).backward(go)
            float8kit.precompute_scales(layer)
            if device != "cpu":
                torch.cuda.synchronize()
    return layer, x, go


def count(
    impl: str, recipe: str, m: int, k: int, n: int, ao_float8=None, device: str = "cpu"
) -> dict:
    """Compile fwd+bwd of one layer on ``device`` and summarize its kernels (``summarize``),
    with the per-kernel records under ``"detail"``."""
    torch._dynamo.reset()
    layer, x, go = steady_layer(impl, recipe, m, k, n, ao_float8, device)
    compiled = torch.compile(layer, fullgraph=True)
    # CPU emulates the blockwise gemm in fp32: count the CUDA kernel's operands instead
    stub = recipe == "blockwise" and device == "cpu"
    block = cuda_block_gemm_path() if stub else contextlib.nullcontext()
    # a cached graph skips the scheduler: compile every time
    with block, record_kernels() as graphs, inductor_config.patch(force_disable_caches=True):
        compiled(x).backward(go)
    torch._dynamo.reset()
    return {**summarize(graphs, m, k, n), "detail": graphs}


# ----------------------------------------------------------------------------
# eager: elementwise passes per operand

# Profiler leaves that move no operand data (allocation, views, metadata).
_NO_DATA = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::as_strided",
    "aten::view",
    "aten::_reshape_alias",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::select",
    "aten::slice",
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::result_type",
    "aten::set_",
    "aten::resize_",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::zeros_like",
    "aten::fill_",
    "aten::zero_",
    "aten::to",  # a leaf only when it converts nothing (a real one calls aten::_to_copy)
    "aten::as_strided_",
    "detach",
}
_EAGER_GEMMS = ("aten::mm", "aten::addmm", "aten::_scaled_mm", "float8kit::cpu_scaled_mm")


def eager_passes(
    impl: str,
    recipe: str,
    m: int,
    k: int,
    n: int,
    ao_float8=None,
    device: str = "cpu",
    verbose: bool = False,
) -> dict[str, int]:
    """Elementwise passes per operand of one eager fwd+bwd (steady state): the kernels that
    read an operand-sized tensor (M*K input, K*N weight, M*N grad_output), gemms aside.

    From the profiler's innermost data-moving ops (each launches one kernel on a GPU);
    float8kit's own ops (``float8kit::cast_tensorwise``) count as one pass each, as their
    CUDA kernel runs, not as the torch ops of their CPU reference."""
    layer, _, go = steady_layer(impl, recipe, m, k, n, ao_float8, device)
    # a fresh input (a cast of the same tensor could be shared across steps: shared_cast),
    # and no gradient to accumulate into: the profiled step's .grad are new tensors
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    for p in layer.parameters():
        p.grad = None
    sizes = {"input": m * k, "weight": k * n, "grad_output": m * n}
    passes = dict.fromkeys(sizes, 0)
    seen: dict[str, list[str]] = {op: [] for op in sizes}
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        layer(x).backward(go)

    def kernels(ev):
        """The ops under ``ev`` that run a kernel: the innermost ones that move data (an op
        whose only children move none, e.g. clamp's scalar conversions, is one)."""
        if ev.name.startswith("float8kit::"):
            return [ev]
        inner = [kr for child in ev.cpu_children for kr in kernels(child)]
        if inner:
            return inner
        if ev.name in _NO_DATA or not ev.name.startswith("aten::"):
            return []  # (autograd's nodes, the subclass's dispatch: their ops are children)
        return [ev]

    roots = [e for e in prof.events() if e.cpu_parent is None]
    for ev in (kr for root in roots for kr in kernels(root)):
        if ev.name in _EAGER_GEMMS:
            continue
        numels = {math.prod(s) for s in ev.input_shapes if s}
        for op, size in sizes.items():
            if size in numels:
                passes[op] += 1
                seen[op].append(ev.name)
    if verbose:
        print(f"    eager {impl} {recipe}: {seen}")
    return passes


# ----------------------------------------------------------------------------
# main


def parse_shape(s: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in s.lower().split("x"))
    return m, k, n


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        default="256x512x1024,512x256x256",
        help="comma list of MxKxN; one proportional to 4096x8192x16384 is also written "
        "scaled to it",
    )
    p.add_argument("--recipes", default=None, help="comma list (default: all, and bf16)")
    p.add_argument("--no-torchao", action="store_true", help="skip torchao.float8's rows")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument(
        "--device",
        default="cpu",
        help="where inductor compiles (cpu: its C++ kernels; cuda: its Triton kernels)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print every kernel")
    args = p.parse_args()

    torch.set_num_threads(1)  # compile time on a shared CPU; the counts do not depend on it
    info = common.run_info(torch.device(args.device))
    ao_float8 = None
    if not args.no_torchao:
        ao_float8, ao_version = common.import_torchao_float8()
        if ao_float8 is None:
            print(f"# torchao.float8 not available: {ao_version}")
    wanted = args.recipes.split(",") if args.recipes else ["bf16", *FLOAT8KIT_RECIPES]
    jobs = [("float8kit" if r != "bf16" else "bf16", r) for r in wanted]
    if ao_float8 is not None:
        jobs += [("torchao", r) for r in TORCHAO_RECIPES if r in wanted]

    rows = []
    for shape in (parse_shape(s) for s in args.shapes.split(",")):
        m, k, n = shape
        ratio = SEED_SHAPE[0] // m
        proportional = (
            all(s == d * ratio for s, d in zip(SEED_SHAPE, shape, strict=True)) and ratio > 1
        )
        for impl, recipe in jobs:
            t0 = time.perf_counter()
            got = count(
                "float8kit" if impl == "bf16" else impl, recipe, m, k, n, ao_float8, args.device
            )
            row = {
                "recipe": recipe,
                "impl": impl,
                "shape": [m, k, n],
                **{
                    key: got[key]
                    for key in (
                        "bytes",
                        "kernels",
                        "per_element",
                        "other_bytes",
                        "gemm_bytes",
                        "gemms",
                        "graphs",
                    )
                },
                "compile_s": round(time.perf_counter() - t0, 1),
            }
            if got["per_element"] is not None:  # M*K, K*N, M*N differ: passes per operand
                row["eager_passes"] = eager_passes(
                    "float8kit" if impl == "bf16" else impl,
                    recipe,
                    m,
                    k,
                    n,
                    ao_float8,
                    args.device,
                    args.verbose,
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.verbose:
                for gi, g in enumerate(got["detail"]):
                    for kr in g:
                        print(f"    graph {gi} {kr}")
        for recipe in dict.fromkeys(r for _, r in jobs):
            rows.append(
                {
                    "recipe": recipe,
                    "impl": "minimum",
                    "shape": [m, k, n],
                    "bytes": minimum_bytes(recipe, m, k, n),
                    "kernels": None,
                }
            )
        if proportional:
            scale = ratio * ratio
            for r in [r for r in rows if r["shape"] == [m, k, n]]:
                rows.append(
                    {
                        **{key: v for key, v in r.items() if key != "compile_s"},
                        "shape": list(SEED_SHAPE),
                        "bytes": r["bytes"] * scale,
                        "gemm_bytes": r.get("gemm_bytes", 0) * scale if "gemm_bytes" in r else None,
                        "scaled_from": [m, k, n],
                    }
                )
    payload = {**info, "kind": "traffic", "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
