"""The measuring code: what makes every number tools/measure.py writes to numbers/*.json.

One module per family of numbers; tests import these modules to assert on the same
measurements, and nothing here imports a test module (tests/test_architecture.py checks). A
published number is stale when the library or this code changed, not when a test did.

    refs.py            SQNR and the fp32 forward/backward reference
    gloo.py            the gloo launcher (real processes, one per rank), FSDP2 models, data,
                       training loop, collective counters
    numerics.py        SQNR tables: recipes vs fp32 and torchao, outliers, scaling policies
    memory.py          bytes kept for backward: the live-tensor counter, per layer, train step
    memory_blocks.py   ... per transformer block, eager and compiled
    monitor.py         Float8Monitor's drift case and overhead
    experts.py         float8 MoE experts' SQNR; experts_hf.py: a tiny HF Qwen3-MoE
    fsdp.py            FSDP2 workers (tensorwise, delayed, static); fsdp_rowwise.py,
                       fsdp_blockwise.py, fsdp_mesh.py: the other granularities and meshes
    qgz.py             the float8 gradient reduce-scatter's gloo worker
    tp.py              tensor / sequence parallel and FSDP2 x TP workers
    expert_parallel.py expert parallelism's gloo worker (EP 2 and 4)
    ep_simulated.py    expert parallelism at 8..256 ranks simulated in one process; torchao's
                       MXFP8 EP dispatch rebuilt from its CPU parts
"""
