"""The TAPS paper's own numbers, for a separate side-by-side table (never mixed with ours).

Source: the TAPS authors' repository README (`Moe-Zbeeb/TAPS`, commit 6234472, April 2026).
Setting: target Meta-Llama-3-8B-Instruct; HASS and EAGLE-2 single-layer heads; tree
total_token 60, depth 5, top_k 10; 4×A100. Metric: acceptance length with the TAPS tau definition
(docs/algorithms.md#acceptance-length). Each cell is (HASS, EAGLE-2).
"""

from __future__ import annotations

PAPER_SOURCE = (
    "TAPS authors' repository README (Moe-Zbeeb/TAPS, commit 6234472, April 2026): "
    "target Meta-Llama-3-8B-Instruct, tree 60/5/10, 4×A100, TAPS tau definition"
)
PAPER_BENCHMARKS = ("mt_bench", "gsm8k", "math_500", "svamp")

# temperature -> drafter -> (MT-Bench, GSM8K, MATH-500, SVAMP, Average), each (HASS, EAGLE-2)
PAPER_TAU: dict[float, dict[str, tuple[tuple[float, float], ...]]] = {
    0.0: {
        "MathInstruct": ((2.90, 2.54), (5.02, 5.04), (5.35, 5.28), (3.13, 4.81), (4.10, 4.42)),
        "ShareGPT": ((3.98, 3.57), (4.09, 3.72), (3.98, 3.81), (4.44, 3.71), (4.12, 3.70)),
        "Mixed 35k+35k": ((3.92, 3.37), (4.77, 4.12), (5.02, 4.44), (4.15, 4.16), (4.47, 4.02)),
        "Mixed 70k+70k": ((4.13, 3.75), (5.53, 4.68), (5.67, 4.85), (5.38, 4.64), (5.18, 4.48)),
        "Averaged": ((2.29, 2.07), (2.80, 2.53), (3.12, 2.57), (2.13, 2.50), (2.59, 2.42)),
        "Confidence routed": ((3.93, 3.63), (5.01, 4.91), (5.37, 5.25), (4.89, 4.71), (4.80, 4.63)),
        "Merged trees": ((4.05, 3.93), (5.42, 5.32), (5.65, 5.63), (5.31, 5.25), (5.11, 5.02)),
    },
    1.0: {
        "MathInstruct": ((2.31, 2.43), (4.75, 4.71), (4.63, 4.61), (2.46, 4.53), (3.54, 4.07)),
        "ShareGPT": ((3.50, 3.38), (4.03, 3.72), (3.61, 3.43), (3.95, 3.65), (3.77, 3.54)),
        "Mixed 35k+35k": ((3.46, 3.10), (4.66, 4.08), (4.47, 4.02), (4.57, 4.03), (4.29, 3.81)),
        "Mixed 70k+70k": ((3.17, 2.99), (4.16, 3.76), (3.42, 3.20), (4.01, 3.08), (3.69, 3.26)),
        "Averaged": ((2.10, 2.01), (2.78, 2.49), (2.90, 2.42), (2.69, 2.45), (2.62, 2.34)),
        "Confidence routed": ((3.51, 3.36), (4.72, 4.65), (4.55, 4.62), (4.71, 4.46), (4.37, 4.27)),
        "Merged trees": ((3.76, 3.55), (5.21, 5.01), (4.98, 4.79), (5.05, 4.93), (4.75, 4.57)),
    },
}

# Other figures from the same README.
PAPER_ROUTING = {"gsm8k_to_math": 0.908, "mt_bench_to_chat": 0.812}  # confidence routing, share of questions
PAPER_ENTROPY_GAP_NATS = (0.35, 1.46)  # rejected − accepted draft-token entropy
PAPER_NOTES = (
    "The averaging interpolation curve is U-shaped with its worst point at w = 0.5. An earlier report in the same "
    "repository gives 4.935 (not 3.13) for the HASS MathInstruct SVAMP cell."
)
