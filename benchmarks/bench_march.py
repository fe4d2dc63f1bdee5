"""What compiling for an explicit target costs against ``-march=native`` (issue 40).

The host toolchain compiles for an explicit target derived from the CPU's features
(``-march=x86-64-vN -mtune=generic -m<feature>...``: compile/toolchains/cpu_target.py), so
that two CPU models with the same features share artifacts and no node loads code it cannot
run. The price can only be in the compiled code: generic tuning instead of this model's, and
no instructions of features outside `cpu_target.FEATURES`.

Ours: a graph of Inductor-generated kernels (pointwise chains, softmax, layer norm: no
matrix product, which runs in oneDNN/BLAS whatever the flags) compiled by the host toolchain
as it compiles now, loaded, and called. Baseline, in the same process: the same graph
compiled with torch's own flags (``-march=native``: the toolchain given no CPU to derive a
target from), loaded and called. Calls of both alternate, round by round; judged on the
median of per-round ratios of time per call, on one thread. Target: explicit / native
<= 1.05x. The outputs of both equal eager PyTorch's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ._harness import machine, measure, paired_ratio, sized

TARGET = 1.05


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks march", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=sized(9, 1))
    parser.add_argument("--calls", type=int, default=sized(100, 5), help="calls per round")
    args = parser.parse_args([] if argv is None else argv)
    print(machine())

    import torch

    from vllm_neuron.compile.toolchains.host import HostToolchain

    class Kernels(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.gelu(x) * torch.sigmoid(x * 1.7) + torch.tanh(x) * w
            y = torch.softmax(y, dim=-1) + torch.nn.functional.layer_norm(y, y.shape[-1:])
            return torch.nn.functional.silu(y).exp().log1p() * torch.rsqrt(y * y + 1.0)

    # One thread: the machine is shared, and the question is the code each flag set makes,
    # not how two OpenMP threads fare beside other jobs.
    torch.set_num_threads(1)
    rows, cols = sized(256, 32), sized(1024, 256)
    x, w = torch.randn(rows, cols), torch.randn(cols)
    gm = torch.fx.symbolic_trace(Kernels())
    eager = gm(x, w)
    toolchains = {"explicit": HostToolchain(), "native": HostToolchain(cpu=None)}
    calls = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, toolchain in toolchains.items():
            target = toolchain.host_target()
            print(f"  {name}: {target.describe[:100]}")
            start = time.perf_counter()
            meta = toolchain.compile(gm, (x, w), os.path.join(scratch, name))
            print(f"    compiled in {time.perf_counter() - start:.1f} s")
            run = toolchain.load(os.path.join(scratch, name), meta)
            torch.testing.assert_close(run(x, w), eager, rtol=1e-4, atol=1e-4)
            calls[name] = run
        assert toolchains["explicit"].host_target().cflags, "no explicit target on this node"
        assert not toolchains["native"].host_target().cflags

        def case(run: object) -> object:
            def go(n: int) -> None:
                for _ in range(n):
                    run(x, w)  # type: ignore[operator]
            return go

        timings = measure({name: case(run) for name, run in calls.items()},  # type: ignore[misc]
                          args.calls, args.rounds)
    print(f" {rows}x{cols} float32, {args.calls} calls x {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}:")
    for timing in timings.values():
        print(timing.line())
    ratio = paired_ratio(timings["native"], timings["explicit"])  # rates: native/explicit
    verdict = "met" if ratio <= TARGET else "NOT MET"
    print(f"  explicit/native time per call {ratio:.3f}x median of per-round ratios "
          f"(best/best {timings['native'].best / timings['explicit'].best:.3f}x); "
          f"{verdict}: target <= {TARGET}x")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
