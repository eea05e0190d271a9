"""What a decode step's linear layers cost per weight format on this CPU: the static decoder's
float32 weights prepacked for oneDNN (what `rollout.decoder: static` runs in float32) against
int8 weight-only weights with per-row scales (`torch._weight_int8pack_mm`, torch's CPU kernel
for weight-only int8, a quarter of the bytes to stream).

    python benchmarks/decode_weights.py            # SmolLM2-135M's shapes: 30 layers + LM head
    python benchmarks/decode_weights.py --tiny     # a 2-layer toy shape, to check the script works

A float32 decode step on an AVX2 CPU streams every weight once (540 MB for the embedded
model), so fewer bytes per weight is the lever left for decode speed (docs/benchmarks.md,
"Where the time goes"); this measures whether torch's own int8 kernel delivers it here. Random weights
(the timing does not depend on the values); median of 7 passes after one warm-up. Prints
milliseconds per pass over all linears at each batch size (rows) and the ratio
float32 / int8 (above 1: int8 is faster); the last line is ``int8_speedup_at_16_rows=X.XX``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _shapes(tiny: bool) -> list[tuple[int, int]]:
    """[out, in] of every linear a decode step runs: fused q/k/v, o, fused gate/up, down per layer, then the LM head."""
    if tiny:
        return [(96, 64), (64, 64), (256, 64), (64, 128)] * 2 + [(1000, 64)]
    return [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _median_ms(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    from plainrl.models.precision import cpu_summary
    from plainrl.rollout.engines.static_decoder import _packed_linear, _prepack

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 8, 4, 1])
    args = p.parse_args(argv)
    torch.manual_seed(0)
    shapes = _shapes(args.tiny)
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    packed = [_prepack(w) for w in weights]
    int8 = []
    for w in weights:  # symmetric per-row quantization: w ~= q * scale
        scale = w.abs().amax(1) / 127
        int8.append(((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale))
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"{cpu_summary()}; threads {torch.get_num_threads()}; torch {torch.__version__}; "
          f"{len(shapes)} linears, {mb:.0f} MB in float32")
    ratio = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        f32 = _median_ms(lambda: [_packed_linear(xs[w.shape[1]], p) for w, p in zip(weights, packed)])
        i8 = _median_ms(lambda: [torch._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in int8])
        ratio[rows] = f32 / i8
        print(f"rows {rows:2d}: float32 prepacked {f32:7.1f} ms, int8 weight-only {i8:7.1f} ms, "
              f"float32/int8 {ratio[rows]:.2f}")
    if 16 in ratio:
        print(f"int8_speedup_at_16_rows={ratio[16]:.2f}")


if __name__ == "__main__":
    main()
