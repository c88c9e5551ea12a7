"""Every pseudo-gradient codec side by side against `none`, at an equal number of tokens, in one run.

    .venv/bin/python benchmarks/codecs.py            # ~12 min on 2 CPU cores
    .venv/bin/python benchmarks/codecs.py --quick    # smoke test, ~2 min, results in a temp folder
    .venv/bin/python benchmarks/codecs.py --codecs none --none-runs 1 --merge \
        --variant "topk-2bit=--compression topk --topk-k 24 --topk-bits 2"   # add runs to the results

A variant is a labelled run with node flags of its own (a codec and its options, or the outer
optimizer as well); `--merge` adds runs to the JSON already in --out-dir, replacing runs of the
same label, and rewrites the report, so a new variant lands beside the codecs measured before.

(a) Throughput, in this process on one core (torch.set_num_threads(1)): a realistic pseudo-gradient
    Δ = φ − θ after 20 AdamW steps of the node's model (the package's build_model, ByteDataset and
    InnerTrainer with the node's default hyperparameters), encoded and decoded with
    `diloco_node.codec.make_codec` and the codec options a node would use (NodeConfig defaults).
    MB/s are of fp32 input (4 bytes per parameter). A fresh codec per repetition, so top-k's error
    feedback always starts empty, as in a node's first round.
(b) Training: for each codec, 2 nodes of the real CLI (`diloco-node join --compression <codec>`) on
    loopback, the same H and number of rounds, `--min-peers 2 --threads 1`, no checkpoints, a run id
    of its own. Everything is read from the nodes' log lines: bytes per parameter per round
    (`payload` = the encoded pseudo-gradient with its wire header; `sent` = all a node put on the
    swarm in the round, i.e. payload plus the exchange protocol's request/length overhead), eval loss
    after every round, and `codec_seconds` (encoding ours, decoding ours and the peer's) against the
    round's `seconds`.

A node's data order is derived from its random peer id, so two runs of the same codec differ a
little; a second `none` run (`--none-runs 2`, the default) measures that run-to-run noise, which
bounds what an eval-loss gap of a fraction of a percent can mean.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from diloco_node.codec import CODECS, FEEDBACK, SPECS, codec_config_of, make_codec
from diloco_node.config import FEEDBACK_OUTER, NodeConfig
from diloco_node.config.defaults import keeps_residual
from diloco_node.outer.diloco import pseudo_gradient
from diloco_node.train.bytedata import ByteDataset
from diloco_node.train.inner import InnerTrainer
from diloco_node.train.model import build_model
from diloco_node.train.sources import load_corpus
from harness.bench import RESULTS_DIR, StartupStalled, inner_config, machine_info, pair, pyplot, run_pair
from harness.nodes import BLOCKING_FLAGS, PUBLISHED_OUTER, WORLD

NAME = "codecs"
# codec → (max payload bytes per parameter per round, max eval-loss gap to `none` in %)
TARGETS: dict[str, tuple[float, float]] = {"int8": (1.05, 0.5), "int4": (0.55, 1.0), "topk": (0.1, 2.0),
                                           "sign": (0.1, 2.0)}
CODEC_SHARE_TARGET = 5.0  # % of round time spent encoding + decoding, every codec
SAMPLE_STEPS = 20  # AdamW steps behind the throughput benchmark's pseudo-gradient
JOIN_TIMEOUT = 90.0  # seconds for both nodes to join; they normally take 8-20 s on 2 cores
START_ATTEMPTS = 2  # a pair that never joins is stopped and started again, once


# --- (a) throughput ---------------------------------------------------------------------------

def sample_pseudo_gradient(cfg: NodeConfig, steps: int) -> torch.Tensor:
    """Δ = φ − θ after `steps` inner AdamW steps from the initial model, flattened (fp32)."""
    dataset = ByteDataset(load_corpus(cfg.inputs.data), cfg.inputs.seq_len)
    model = build_model(cfg.inputs.model, cfg.inputs.seed)
    outer = [p.detach().clone().float() for p in model.parameters()]
    trainer = InnerTrainer(model, inner_config(cfg, 0))
    for step in range(steps):
        trainer.train_step(*dataset.train_batch(cfg.inputs.batch_size, cfg.inputs.seed, step))
    return torch.cat([d.reshape(-1) for d in pseudo_gradient(outer, list(model.parameters()))]).contiguous()


def outer_step(flags: list[str]) -> tuple[str, ...]:
    """DiLoCo's published outer step for a dense codec; an error-feedback one takes FEEDBACK_OUTER."""
    return () if keeps_residual(flag_options(flags).get("compression")) else PUBLISHED_OUTER


def flag_options(flags: list[str]) -> dict[str, str]:
    """["--topk-k", "24", ...] → {"topk_k": "24", ...}: node flags as NodeConfig keys."""
    if len(flags) % 2 or not all(f.startswith("--") for f in flags[::2]):
        raise ValueError(f"flags must come as --name value pairs: {' '.join(flags)}")
    return {name[2:].replace("-", "_"): value for name, value in zip(flags[::2], flags[1::2], strict=True)}


def measure_codec(name: str, flat: torch.Tensor, min_seconds: float, min_reps: int = 5,
                  flags: list[str] | None = None) -> dict[str, Any]:
    codec_cfg = codec_config_of(NodeConfig(**flag_options(flags or ["--compression", name])))
    numel = flat.numel()
    payload = make_codec(codec_cfg).encode(flat)  # warm-up, and the numbers of one round trip
    decoded = make_codec(codec_cfg).decode(payload, numel)
    rel_error = float((decoded - flat).norm() / flat.norm())
    encode_s, decode_s = [], []
    while sum(encode_s) + sum(decode_s) < min_seconds or len(encode_s) < min_reps:
        codec = make_codec(codec_cfg)
        started = time.perf_counter()
        payload = codec.encode(flat)
        encoded = time.perf_counter()
        codec.decode(payload, numel)
        encode_s.append(encoded - started)
        decode_s.append(time.perf_counter() - encoded)
    enc, dec, mb = statistics.median(encode_s), statistics.median(decode_s), 4 * numel / 1e6
    return {"codec": name, "reps": len(encode_s), "encode_seconds": enc, "decode_seconds": dec,
            "encode_mb_s": mb / enc, "decode_mb_s": mb / dec, "roundtrip_mb_s": mb / (enc + dec),
            "payload_bytes": len(payload), "bytes_per_param": len(payload) / numel,
            "relative_l2_error": rel_error}


def topk_energy(flat: torch.Tensor, chunk: int, k: int) -> float:
    """Share of |Δ|² in the k largest |values| of each chunk: what top-k can send in one round."""
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % chunk)).view(-1, chunk)
    return float(rows.abs().topk(k, dim=1).values.square().sum() / rows.square().sum())


def run_throughput(cfg: NodeConfig, runs: dict[str, list[str]], min_seconds: float) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.monotonic()
        flat = sample_pseudo_gradient(cfg, SAMPLE_STEPS)
        per_codec = {label: measure_codec(label, flat, min_seconds, flags=flags) for label, flags in runs.items()}
    finally:
        torch.set_num_threads(threads)
    return {"sample": {"steps": SAMPLE_STEPS, "numel": flat.numel(), "l2_norm": float(flat.norm()),
                       "abs_max": float(flat.abs().max()), "abs_mean": float(flat.abs().mean()),
                       "topk_energy_fraction": topk_energy(flat, cfg.codec.topk_chunk, cfg.codec.topk_k)},
            "threads": 1, "seconds": time.monotonic() - started, "codecs": per_codec}


# --- (b) training through the real CLI --------------------------------------------------------

def run_codec(label: str, flags: list[str], h: int, rounds: int, cfg: NodeConfig, work: Path,
              timeout: float) -> dict[str, Any]:
    """One 2-node run; a pair that stalls before joining is recorded and started once more."""
    stalled = []
    for attempt in range(1, START_ATTEMPTS + 1):
        run_id = f"bench-codec-{label}-{os.getpid()}-{int(time.time())}"
        try:
            logs, wall, lo_node = run_pair(label, h, rounds, run_id, work / f"attempt{attempt}", timeout,
                                           checkpoint_dirs=("", ""),
                                           extra=[*BLOCKING_FLAGS, *outer_step(flags), *flags],
                                           join_timeout=JOIN_TIMEOUT)
        except StartupStalled as exc:
            print(f"  {label}: the nodes did not join within {JOIN_TIMEOUT:.0f}s (attempt {attempt}); "
                  f"logs in {work / f'attempt{attempt}'}", file=sys.stderr, flush=True)
            stalled.append({"attempt": attempt, "run_id": run_id, "error": str(exc).splitlines()[0],
                            "stdout": {p.stem.split(".")[0]: p.read_text().splitlines()[-3:]
                                       for p in sorted((work / f"attempt{attempt}").glob("*.stdout.log"))}})
            if attempt == START_ATTEMPTS:
                raise
            continue
        result = summarize(label, flag_options(flags)["compression"], h, rounds, cfg, logs, wall, lo_node)
        result["stalled_starts"], result["flags"] = stalled, flags
        return result
    raise AssertionError("unreachable")


def summarize(label: str, codec: str, h: int, rounds: int, cfg: NodeConfig, logs: list[dict[str, Any]],
              wall: float, lo_node: int | None) -> dict[str, Any]:
    params = logs[0]["joined"]["parameters"]
    tokens_per_step = cfg.inputs.batch_size * cfg.inputs.seq_len
    exchanged = [r for log in logs for r in log["rounds"] if r["group_size"] > 1]
    if any("payload" not in r for log in logs for r in log["rounds"]):
        raise RuntimeError("a round line has no payload= / codec_seconds=; did the log format change?")
    final = [log["rounds"][-1] for log in logs]
    # The joiner downloads φ and the outer momentum once; the node that served them counts them in
    # its first round's `sent`. The joiner's own `sent` is pseudo-gradient traffic alone: plot that.
    joiner = next((i for i, log in enumerate(logs) if log["synced_round"] is not None),
                  min(range(WORLD), key=lambda i: sum(r["sent"] for r in logs[i]["rounds"])))
    joiner_exchanges = max(1, sum(1 for r in logs[joiner]["rounds"] if r["group_size"] > 1))
    # Per round, `payload` is attributed to the right round but `sent` sometimes is not (problems()): the
    # curves count each round's payload plus the node's mean framing per round, which sums to the logged
    # total for the joiner; `bytes_sent_logged` keeps the raw running sum of `sent`.
    curves = []
    for log in logs:
        exchanges = max(1, sum(1 for r in log["rounds"] if r["group_size"] > 1))
        framing = (sum(r["sent"] for r in log["rounds"]) - sum(r["payload"] for r in log["rounds"])) / exchanges
        cumulative, logged, curve = 0.0, 0, []
        for r in log["rounds"]:
            cumulative += r["payload"] + (framing if r["group_size"] > 1 else 0)
            logged += r["sent"]
            curve.append({"round": r["round"], "bytes_sent": round(cumulative), "bytes_sent_logged": logged,
                          "eval_loss": r["eval_loss"]})
        curves.append(curve)
    return {
        "label": label, "codec": codec, "H": h, "rounds": rounds, "parameters": params, "logs": logs,
        "rounds_per_node": [len(log["rounds"]) for log in logs],
        "tokens_per_node": [len(log["rounds"]) * h * tokens_per_step for log in logs],
        "exchanges_per_node": [sum(1 for r in log["rounds"] if r["group_size"] > 1) for log in logs],
        "initial_eval_loss": logs[0]["joined"]["eval_loss"],
        "final_eval_loss": final[0]["eval_loss"], "final_eval_loss_per_node": [f["eval_loss"] for f in final],
        "replicas_identical": len({f["digest"] for f in final}) == 1,
        # The median round: leaves out the one-off state download at join.
        "payload_bytes_per_param": statistics.median([r["payload"] for r in exchanged] or [0]) / params,
        # The median payload plus the joiner's mean protocol overhead per exchange, from its totals, which
        # a payload counted a round late (see problems()) does not disturb; the joiner serves no state.
        "sent_bytes_per_param": (statistics.median([r["payload"] for r in exchanged] or [0])
                                 + (sum(r["sent"] for r in logs[joiner]["rounds"])
                                    - sum(r["payload"] for r in logs[joiner]["rounds"])) / joiner_exchanges) / params,
        "sent_bytes_per_param_mean": sum(r["sent"] for r in logs[joiner]["rounds"]) / joiner_exchanges / params,
        "overhead_bytes_per_round": statistics.median([r["sent"] - r["payload"] for r in exchanged] or [0]),
        "bytes_sent_per_node": [sum(r["sent"] for r in log["rounds"]) for log in logs],
        "payload_bytes_per_node": [sum(r["payload"] for r in log["rounds"]) for log in logs],
        "codec_seconds": sum(r["codec_seconds"] for log in logs for r in log["rounds"]),
        "round_seconds": sum(r["seconds"] for log in logs for r in log["rounds"]),
        "codec_share_percent": 100 * sum(r["codec_seconds"] for log in logs for r in log["rounds"])
        / max(1e-9, sum(r["seconds"] for log in logs for r in log["rounds"])),
        "median_round_seconds": statistics.median(r["seconds"] for log in logs for r in log["rounds"]),
        "curve_node": joiner + 1, "curves": curves,
        "lo_bytes_per_node_upper_bound": lo_node, "wall_seconds": wall,
        "warnings": sum(len(log["warnings"]) for log in logs),
    }


# --- report -----------------------------------------------------------------------------------

def gap_percent(res: dict[str, Any], base: dict[str, Any]) -> float:
    return 100 * (res["final_eval_loss"] - base["final_eval_loss"]) / base["final_eval_loss"]


def gap_trend(res: dict[str, Any], base: dict[str, Any]) -> tuple[float, str, int | None]:
    """The eval-loss gap at the middle round, whether it narrowed from there to the end, and the
    round after which the codec's eval loss stopped improving (None when it improved to the end)."""
    mid = max(1, res["rounds"] // 2)
    ours = {r["round"]: r["eval_loss"] for r in res["logs"][0]["rounds"]}
    theirs = {r["round"]: r["eval_loss"] for r in base["logs"][0]["rounds"]}
    best = min(ours, key=lambda r: ours[r]) if ours else None
    stalled = best if best is not None and best <= max(ours) - 3 else None
    if mid not in ours or mid not in theirs:
        return float("nan"), "trend unknown", stalled
    gap_mid = 100 * (ours[mid] - theirs[mid]) / theirs[mid]
    return gap_mid, "narrowing" if gap_percent(res, base) < gap_mid - 0.5 else "not narrowing", stalled


def format_raw_length(name: str, cfg: NodeConfig) -> str:
    """The codec's body size in bytes per parameter before zstd, as the format defines it."""
    if name == "none":
        return "4"
    if name in ("fp16", "bf16"):
        return "2"
    if name == "int8":
        return f"1 + 2/{cfg.codec.block_size} = {1 + 2 / cfg.codec.block_size:.3f}"
    if name == "int4":
        return f"0.5 + 2/{cfg.codec.block_size} = {0.5 + 2 / cfg.codec.block_size:.3f}"
    if name == "sign":
        return (f"{cfg.codec.sign_keep:g}·(2 + {cfg.codec.sign_block}/8)/{cfg.codec.sign_block} = "
                f"{cfg.codec.sign_keep * (2 + cfg.codec.sign_block / 8) / cfg.codec.sign_block:.3f}")
    per_chunk = 2 + cfg.codec.topk_k * (1 + cfg.codec.topk_bits / 8)
    chunk = cfg.codec.topk_chunk
    return f"(2 + {cfg.codec.topk_k}·(1 + {cfg.codec.topk_bits}/8))/{chunk} = {per_chunk / chunk:.3f}"


def run_config(res: dict[str, Any]) -> NodeConfig:
    """The node settings a run used: the benchmark's, then its own flags."""
    return NodeConfig(**{"sync": "blocking", **flag_options(res.get("flags", ["--compression", res["codec"]]))})


def gap_reason(res: dict[str, Any], payload: dict[str, Any], max_bpp: float) -> str:
    """Why a lossy codec's run ended behind `none`, from its curve and its settings."""
    base = next(r for r in payload["results"] if r["label"] == "none")
    cfg, name, gap = run_config(res), res["codec"], gap_percent(res, base)
    tp = payload["throughput"]["codecs"]
    err = tp.get(res["label"], tp.get(name, {})).get("relative_l2_error", float("nan"))
    mid, trend, stalled = gap_trend(res, base)
    curve = (f"{trend}: {mid:+.1f} % at round {res['rounds'] // 2}, {gap:+.1f} % at the end"
             + (f"; no better since round {stalled}" if stalled is not None else ""))
    if not SPECS[name].feedback:
        return (f"quantization error (rel. L2 error {err:.3f} per round trip) is not fed back; error "
                f"feedback as {' and '.join(FEEDBACK)} have, or a smaller --block-size, would reduce it")
    if cfg.outer.outer_momentum > 0:
        return (f"error feedback (β = {cfg.codec.ef_decay:g}) under outer Nesterov momentum "
                f"{cfg.outer.outer_momentum:g}: "
                "the residual sends each value late, and momentum then keeps pushing what was already sent, so φ "
                f"overshoots and stalls ({curve}; rel. L2 error {err:.2f} per round trip); error feedback in "
                "place of momentum (" + " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in FEEDBACK_OUTER.items())
                + ", what these codecs take where unset) is in the other rows")
    sample = payload["throughput"]["sample"]
    if name == "topk":
        return (f"AdamW's pseudo-gradient is spread almost evenly (max |Δ| = "
                f"{sample['abs_max'] / sample['abs_mean']:.1f}x the mean |Δ|), so {cfg.codec.topk_k} of "
                f"{cfg.codec.topk_chunk} values per chunk carry little of its energy (rel. L2 error {err:.2f} per "
                f"round trip) and error feedback sends the rest rounds late ({curve}); sign bits of whole blocks "
                "carry more per byte")
    keep_max = max_bpp * cfg.codec.sign_block / (2 + cfg.codec.sign_block / 8)
    return (f"{cfg.codec.sign_keep:g} of the blocks per round as sign × mean |x| (rel. L2 error {err:.2f} per round "
            f"trip); error feedback sends the rest a round or more late ({curve}). More blocks per round "
            f"(--sign-keep) cost bytes: {max_bpp} B/param allows about {keep_max:.2f}")


def check_targets(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target and run (variants included): what, measured, pass, and for a miss why and what
    would reach it."""
    results = payload["results"]
    base, noise = next(r for r in results if r["label"] == "none"), payload.get("noise_percent")
    rows = []
    for res in results:
        name, label = res["codec"], res["label"]
        if name not in TARGETS or "#" in label:  # the noise run repeats `none`
            continue
        max_bpp, max_gap = TARGETS[name]
        bpp = res["payload_bytes_per_param"]
        why = ""
        if bpp > max_bpp:
            why = (f"the format alone is {format_raw_length(name, run_config(res))} B/param before zstd and zstd "
                   f"left {bpp:.3f}; fewer values or scales per parameter would lower it")
        rows.append({"codec": label, "target": f"≤ {max_bpp} B/param per round (payload, median round)",
                     "measured": f"{bpp:.3f}", "pass": bpp <= max_bpp, "why": why})
        gap = gap_percent(res, base)
        why = ""
        if gap > max_gap:
            if noise is not None and gap <= max_gap + noise:
                why = (f"the gap is within the run-to-run noise ({noise:.2f} % between two `none` runs), so this "
                       "run cannot tell; more rounds or averaging several runs per codec would settle it")
            else:
                why = gap_reason(res, payload, max_bpp)
            if noise is None:
                why += "; run with --none-runs 2 to see how much of it is run-to-run noise"
        rows.append({"codec": label, "target": f"eval loss within {max_gap} % of none", "measured": f"{gap:+.2f} %",
                     "pass": gap <= max_gap, "why": why})
    for res in results:
        if "#" in res["label"]:
            continue
        share = res["codec_share_percent"]
        why = ""
        if share > CODEC_SHARE_TARGET:
            per_round = res["codec_seconds"] / max(1, sum(res["rounds_per_node"]))
            why = (f"{per_round * 1000:.0f} ms of codec work per round against a {res['median_round_seconds']:.1f} s "
                   f"round (H={res['H']} inner steps of a small model); the share falls as 1/H, and a faster "
                   "encoder (fewer passes over Δ, zstd off where it gains little) would cut it")
        rows.append({"codec": res["label"], "target": f"codec time ≤ {CODEC_SHARE_TARGET:g} % of the round",
                     "measured": f"{share:.2f} %", "pass": share <= CODEC_SHARE_TARGET, "why": why})
    return rows


def markdown(payload: dict[str, Any]) -> str:
    results = payload["results"]
    base = next(res for res in results if res["label"] == "none")
    throughput = payload["throughput"]["codecs"]
    rows = ["| codec | payload B/param/round | sent B/param/round | less traffic than none | bytes sent per node | "
            "final eval loss | gap vs none | enc+dec MB/s/core | codec share of round | rel. L2 error |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        tp = throughput.get(res["label"], throughput.get(res["codec"], {}))
        ratio = base["sent_bytes_per_param"] / res["sent_bytes_per_param"] if res["sent_bytes_per_param"] else 0
        rows.append(
            f"| {res['label']} | {res['payload_bytes_per_param']:.4f} | {res['sent_bytes_per_param']:.4f} | "
            f"{ratio:.1f}x | {pair(res['bytes_sent_per_node'])} | {res['final_eval_loss']:.4f} | "
            f"{gap_percent(res, base):+.2f} % | {tp.get('roundtrip_mb_s', float('nan')):.0f} | "
            f"{res['codec_share_percent']:.2f} % | {tp.get('relative_l2_error', float('nan')):.4f} |")
    return "\n".join(rows)


def targets_markdown(checks: list[dict[str, Any]]) -> str:
    rows = ["| codec | target | measured | result |", "|---|---|---|---|"]
    rows += [f"| {c['codec']} | {c['target']} | {c['measured']} | {'pass' if c['pass'] else '**miss**'} |"
             for c in checks]
    misses = [f"- **{c['codec']}, {c['target']}** missed ({c['measured']}): {c['why']}." for c in checks
              if not c["pass"]]
    return "\n".join(rows) + ("\n\n" + "\n".join(misses) if misses else "\n\nEvery target is met.")


def notes(payload: dict[str, Any]) -> str:
    cfg, config = NodeConfig(sync="blocking"), payload["config"]
    results, tp = payload["results"], payload["throughput"]
    first = results[0]
    lines = [
        f"Model `{cfg.inputs.model}` ({first['parameters']:,} parameters), {WORLD} nodes of the real CLI on loopback, "
        f"H = {config['H']} inner steps x {config['rounds']} rounds, batch {cfg.inputs.batch_size} x seq "
        f"{cfg.inputs.seq_len} bytes, embedded corpus; tokens per node "
        f"{pair(sorted({t for r in results for t in r['tokens_per_node']}))}"
        f" for every codec (from the logs). Codec options: block {cfg.codec.block_size}, top-k {cfg.codec.topk_k} of "
        f"{cfg.codec.topk_chunk} ({cfg.codec.topk_bits}-bit values), sign: the {cfg.codec.sign_keep:g} of "
        f"{cfg.codec.sign_block}-value blocks of largest norm, zstd `{cfg.codec.zstd}` (level "
        f"{cfg.codec.zstd_level}). Outer step: Nesterov, lr {cfg.outer.outer_lr:g}, momentum "
        f"{cfg.outer.outer_momentum:g}; {' and '.join(FEEDBACK)} take error feedback in place of momentum where "
        f"these are unset: momentum {FEEDBACK_OUTER['outer_momentum']:g}, lr {FEEDBACK_OUTER['outer_lr']:g}, "
        f"error-feedback β = {FEEDBACK_OUTER['ef_decay']:g}.",
        "payload B/param/round: the encoded pseudo-gradient with its wire header, the median round over both "
        "nodes. sent B/param/round: that plus the exchange's request and length framing, i.e. (Σ sent − Σ payload) "
        "/ exchanges of the joining node, which serves no state (median "
        f"{statistics.median(r['overhead_bytes_per_round'] for r in results):.0f} B per round). Bytes sent per "
        "node also count the φ + outer momentum (8 B/param) node 1 serves node 2 once at join.",
        f"Throughput: one core, median of repetitions, on Δ after {tp['sample']['steps']} AdamW steps of the "
        f"initial model ({tp['sample']['numel']:,} fp32 values, |Δ|₂ = {tp['sample']['l2_norm']:.3g}); "
        "MB/s of fp32 input for one encode plus one decode. A node does one encode and M decodes per round "
        "(its own payload and each peer's). Rel. L2 error: |D(C(Δ)) − Δ| / |Δ| for one round trip (top-k: its "
        "first round, before error feedback has anything to return).",
        "Codec share of round: Σ codec_seconds / Σ round seconds over both nodes' logs; a round here also waits "
        f"matchmaking_time ({cfg.swarm.matchmaking_time:g} s) for its group, so the share against compute alone "
        "is higher.",
    ]
    variants = [f"{res['label']} `{' '.join(res['flags'])}`" for res in results
                if res.get("flags", ["--compression", res["codec"]]) != ["--compression", res["codec"]]]
    if variants:
        lines.append("Variants, each a run with its own node flags (after `--sync blocking`, the rest as above): "
                     + "; ".join(variants) + ".")
    if payload.get("noise_percent") is not None:
        lines.append(f"Run-to-run noise: two `none` runs differ by {payload['noise_percent']:.2f} % in final eval "
                     "loss (each node's data order comes from its random peer id).")
    fp16 = next((r for r in results if r["label"] == "fp16"), None)
    if fp16 is not None and "fp16" in tp["codecs"]:
        lines.append(f"fp16 is practically lossless (round-trip error {tp['codecs']['fp16']['relative_l2_error']:.4f})"
                     f" and lands at {gap_percent(fp16, results[0]):+.2f} % from `none`: another reading of the "
                     "run-to-run noise; eval-loss gaps of that size do not separate codecs.")
    else:
        lines.append("A node's data order comes from its random peer id, so every run differs a little; "
                     "`--none-runs 2` measures that noise.")
    for res in results:
        tpc = tp["codecs"].get(res["label"], tp["codecs"].get(res["codec"], {}))
        lines.append(
            f"{res['label']}: rounds per node {pair(res['rounds_per_node'])}, exchanges per node "
            f"{pair(res['exchanges_per_node'])}, final φ bit-identical on both nodes: {res['replicas_identical']}, "
            f"node warnings: {res['warnings']}, median round {res['median_round_seconds']:.1f} s, wall "
            f"{res['wall_seconds']:.0f} s; encode {tpc.get('encode_mb_s', float('nan')):.0f} / decode "
            f"{tpc.get('decode_mb_s', float('nan')):.0f} MB/s.")
    return "\n".join(f"- {line}" for line in lines)


def problems(payload: dict[str, Any]) -> str:
    """What the nodes did that a healthy run would not: stalls, warnings, split φ, lonely rounds."""
    lines = []
    for res in payload["results"]:
        label = res["label"]
        for stall in res.get("stalled_starts", []):
            last = "; ".join(f"{node} '{(out or ['(nothing)'])[-1]}'" for node, out in stall["stdout"].items())
            lines.append(f"{label}: start attempt {stall['attempt']} stalled, no `joined` line within "
                         f"{JOIN_TIMEOUT:.0f} s; last stdout lines: {last} (the pair was stopped and started "
                         "again).")
        if not res["replicas_identical"]:
            lines.append(f"{label}: the two nodes ended with different φ (digests differ).")
        if any(n != res["rounds"] for n in res["rounds_per_node"]):
            lines.append(f"{label}: rounds logged per node {pair(res['rounds_per_node'])}, not {res['rounds']}.")
        if any(n != len(log["rounds"]) for n, log in zip(res["exchanges_per_node"], res["logs"], strict=True)):
            lines.append(f"{label}: some rounds averaged alone (exchanges per node {pair(res['exchanges_per_node'])}).")
        late = sum(1 for log in res["logs"] for r in log["rounds"] if r["group_size"] > 1 and r["sent"] < r["payload"])
        if late:
            lines.append(f"{label}: in {late} round(s) a node logged `sent` smaller than its own payload: the peer "
                         "fetched the payload after the node wrote its round line, so those bytes appear in the next "
                         "round's `sent` (totals are right; per-round `sent` is not).")
        if res["warnings"]:
            first = next(w for log in res["logs"] for w in log["warnings"])
            lines.append(f"{label}: {res['warnings']} warning(s), first: `{first.split(' WARN', 1)[-1].strip()}`")
    return "\n".join(f"- {line}" for line in lines) if lines else "None seen: every pair joined, every round " \
        "averaged with the peer, no warnings, and both nodes ended with bit-identical φ for every codec."


def plot(payload: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for res in payload["results"]:
        curve = res["curves"][res["curve_node"] - 1]
        style = {"linestyle": "--"} if res["label"] != res["codec"] else {}
        line, = left.plot([p["bytes_sent"] for p in curve], [p["eval_loss"] for p in curve], marker="o",
                          markersize=3, label=res["label"], **style)
        right.plot([0] + [p["round"] for p in curve], [res["initial_eval_loss"]] + [p["eval_loss"] for p in curve],
                   marker="o", markersize=3, color=line.get_color(), label=res["label"], **style)
    left.set_xscale("log")
    left.set_xlabel("cumulative bytes sent per node (log scale; the joiner's payloads + framing, no join state)")
    left.set_ylabel("held-out eval loss (nats/byte)")
    left.set_title("eval loss vs bytes on the wire")
    right.set_xlabel(f"outer round (H = {payload['config']['H']} inner steps each; equal tokens per round)")
    right.set_title("eval loss vs round")
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    right.xaxis.get_major_locator().set_params(integer=True)
    left.legend(title="codec")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(payload: dict[str, Any], out: Path) -> str:
    """The markdown (table, targets, notes) and the plot, from the JSON's numbers alone."""
    machine = payload["machine"]
    table = markdown(payload)
    checks = check_targets(payload)
    (out / f"{NAME}.md").write_text(
        f"# Pseudo-gradient codecs side by side ({payload['date']}, {machine['nproc']} CPU cores, "
        f"torch {machine['torch']})\n\n" + (f"{payload['note']}\n\n" if payload.get("note") else "")
        + f"{table}\n\n## Targets\n\n{targets_markdown(checks)}\n\n## Node problems\n\n"
        f"{problems(payload)}\n\n## Notes\n\n{notes(payload)}\n\n"
        f"Total benchmark time: {payload['total_seconds']:.0f} s. "
        f"Reproduce: `.venv/bin/python benchmarks/{NAME}.py`. Plot: `{NAME}.png`.\n")
    plot(payload, out / f"{NAME}.png")
    return table + "\n\n" + targets_markdown(checks)


def rewrite_report(out: Path) -> str:
    """--report-only: recompute every derived number from the raw logs in the JSON, rewrite all outputs."""
    payload = json.loads((out / f"{NAME}.json").read_text())
    cfg = NodeConfig(sync="blocking")
    for i, res in enumerate(payload["results"]):
        fresh = summarize(res["label"], res["codec"], res["H"], res["rounds"], cfg, res["logs"],
                          res["wall_seconds"], res["lo_bytes_per_node_upper_bound"])
        payload["results"][i] = {**fresh, "stalled_starts": res.get("stalled_starts", []),
                                 "flags": res.get("flags", ["--compression", res["codec"]])}
    results = payload["results"]
    repeat = next((r for r in results if r["label"] == "none#2"), None)
    payload["noise_percent"] = abs(gap_percent(repeat, results[0])) if repeat else None
    payload["checks"] = check_targets(payload)
    (out / f"{NAME}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return write_report(payload, out)


def merge(out: Path, results: list[dict[str, Any]], throughput: dict[str, Any], seconds: float) -> str:
    """--merge: these runs join (or replace, by label) those in out's JSON; the report is rewritten."""
    payload = json.loads((out / f"{NAME}.json").read_text())
    new = {res["label"]: res for res in results}
    payload["results"] = [new.pop(res["label"], res) for res in payload["results"]] + list(new.values())
    payload["throughput"]["codecs"].update(throughput["codecs"])
    payload["total_seconds"] += seconds
    payload.setdefault("merged", []).append(dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    (out / f"{NAME}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return rewrite_report(out)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inner-steps", type=int, help="H, inner steps per round (default 20; --quick 5)")
    parser.add_argument("--rounds", type=int, help="outer rounds per codec (default 12; --quick 2)")
    parser.add_argument("--codecs", type=str, default=",".join(CODECS),
                        help="comma-separated codecs to compare; `none` is always run unless --merge (default: all)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                        help="a run of its own with these node flags, e.g. 'topk-2bit=--compression topk "
                        "--topk-bits 2' (repeatable)")
    parser.add_argument("--merge", action="store_true", help="add these runs to the JSON in --out-dir "
                        "(replacing runs of the same label) instead of starting a new one")
    parser.add_argument("--none-runs", type=int, choices=(1, 2),
                        help="2 = run `none` a second time to measure run-to-run noise (default 2; --quick 1)")
    parser.add_argument("--throughput-seconds", type=float, help="time spent per codec on the throughput "
                        "measurement (default 2; --quick 0.3)")
    parser.add_argument("--quick", action="store_true", help="small smoke run (H=5, 2 rounds), ~2 min")
    parser.add_argument("--out-dir", type=Path, help=f"results folder (default {RESULTS_DIR}; "
                        "--quick: a fresh temp folder)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per codec run")
    parser.add_argument("--keep-logs", action="store_true", help="keep the nodes' logs")
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown and plot from the "
                        "JSON in --out-dir without running anything")
    args = parser.parse_args()
    args.inner_steps = args.inner_steps or (5 if args.quick else 20)
    args.rounds = args.rounds or (2 if args.quick else 12)
    args.none_runs = args.none_runs or (1 if args.quick else 2)
    args.throughput_seconds = args.throughput_seconds or (0.3 if args.quick else 2.0)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        parser.error(f"unknown codec(s) {', '.join(unknown)} (known: {', '.join(CODECS)})")
    args.codecs = ([] if args.merge and "none" not in codecs else ["none"]) + [
        c for c in CODECS if c in codecs and c != "none"]
    args.runs = {c: ["--compression", c] for c in args.codecs}
    for variant in args.variant:
        label, _, flags = variant.partition("=")
        try:
            if "compression" not in flag_options(flags.split()) or label in args.runs or "#" in label:
                raise ValueError("it needs a new label without '#' and flags that name --compression")
            NodeConfig(**flag_options(flags.split()))
        except ValueError as exc:
            parser.error(f"variant '{variant}': {str(exc).splitlines()[0]}")
        args.runs[label] = flags.split()
    if args.out_dir is None:
        args.out_dir = Path(tempfile.mkdtemp(prefix=f"{NAME}_quick_")) if args.quick else RESULTS_DIR
    return args


def main() -> None:
    args = parse_args()
    if args.report_only:
        print(rewrite_report(args.out_dir))
        return
    cfg = NodeConfig(sync="blocking")
    started = time.monotonic()
    print(f"throughput: {', '.join(args.runs)} on one core ...", flush=True)
    throughput = run_throughput(cfg, args.runs, args.throughput_seconds)
    for name, tp in throughput["codecs"].items():
        print(f"  {name:5s} encode+decode {tp['roundtrip_mb_s']:7.0f} MB/s  {tp['bytes_per_param']:.4f} B/param",
              flush=True)
    runs = [*args.runs.items()] + ([("none#2", args.runs["none"])] if args.none_runs == 2 and "none" in args.runs
                                   else [])
    work = Path(tempfile.mkdtemp(prefix=f"{NAME}_work_"))
    keep, results = args.keep_logs, []
    try:
        for label, flags in runs:
            print(f"{label}: {WORLD} nodes, H={args.inner_steps}, {args.rounds} rounds ...", flush=True)
            res = run_codec(label.replace("#", "-"), flags, args.inner_steps, args.rounds, cfg,
                            work / label.replace("#", "-"), args.timeout)
            res["label"] = label
            results.append(res)
            keep = keep or bool(res["stalled_starts"])  # their logs are the evidence
            print(f"  eval loss {res['final_eval_loss']:.4f}, {res['payload_bytes_per_param']:.4f} B/param, "
                  f"codec {res['codec_share_percent']:.2f} % of round, {res['wall_seconds']:.0f}s", flush=True)
    except BaseException:
        keep = True  # the logs are what explains a failure
        raise
    finally:
        if keep:
            print(f"node logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for res in results:
        for log in res["logs"]:  # raw per-round numbers stay in the JSON; the full log lines do not
            log["warnings"] = log["warnings"][:20]
    if args.merge:
        print(merge(args.out_dir, results, throughput, time.monotonic() - started))
        return
    repeat = next((r for r in results if r["label"] == "none#2"), None)
    noise = abs(gap_percent(repeat, results[0])) if repeat else None
    tokens = {t for res in results for t in res["tokens_per_node"]}
    if len(tokens) != 1:
        print(f"warning: tokens per node differ between runs: {sorted(tokens)}", file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "total_seconds": time.monotonic() - started,
        "config": {"H": args.inner_steps, "rounds": args.rounds, "nodes": WORLD, "equal_tokens": len(tokens) == 1,
                   **{key: value for key, value in cfg.flat().items() if key in {
                       "model", "seq_len", "batch_size", "eval_batches", "seed", "inner_lr", "warmup_steps",
                       "weight_decay", "grad_clip", "outer_lr", "outer_momentum", "matchmaking_time", "block_size",
                       "topk_chunk", "topk_k", "ef_decay", "zstd", "zstd_level"}}},
        "targets": {"codecs": {k: {"max_bytes_per_param": v[0], "max_eval_loss_gap_percent": v[1]}
                               for k, v in TARGETS.items()},
                    "max_codec_share_percent": CODEC_SHARE_TARGET},
        "machine": machine_info(), "throughput": throughput, "noise_percent": noise, "results": results,
    }
    payload["checks"] = check_targets(payload)
    (args.out_dir / f"{NAME}.json").write_text(json.dumps(payload, indent=1) + "\n")
    report = write_report(payload, args.out_dir)
    print(f"\nresults in {args.out_dir}\n\n{report}\n\ntotal {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
