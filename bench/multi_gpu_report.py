"""The analysis and the report of bench/multi_gpu.py: per part, from the jobs' results (their
per-step metrics), the differences to the reference runs, the drill's comparison, the scaling
efficiencies; and the markdown tables with the commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from multi_gpu_plan import DRILL_KEYS, LAYOUTS, REPO, Plan, k_text, layout_text, model_name


def by_step(result: dict | None) -> dict[int, dict]:
    return {r["step"]: r for r in (result or {}).get("records", [])}


def differences(ref: dict | None, other: dict | None) -> dict | None:
    """Per step lm loss of both and their absolute / relative difference; the largest over steps of
    each compared number."""
    a, b = by_step(ref), by_step(other)
    steps = sorted(set(a) & set(b))
    if not steps:
        return None
    rows = []
    for s in steps:
        ref_loss, loss = a[s]["lm_loss"], b[s]["lm_loss"]
        rows.append({"step": s, "ref": ref_loss, "lm_loss": loss, "abs": abs(loss - ref_loss),
                     "rel": abs(loss - ref_loss) / abs(ref_loss)})
    out = {"steps": len(steps), "rows": rows, "max_abs": max(r["abs"] for r in rows),
           "max_rel": max(r["rel"] for r in rows), "max_rel_step": max(rows, key=lambda r: r["rel"])["step"]}
    for key in ("kl_loss", "grad_norm", "moe_aux_loss"):
        rel = [abs(b[s][key] - a[s][key]) / max(abs(a[s][key]), 1e-12) for s in steps
               if a[s].get(key) is not None and b[s].get(key) is not None]
        if rel:
            out[f"{key}_max_rel"] = max(rel)
    return out


def parity_rows(results: dict, names: list[str], ref_name: str, tolerance_floor: float) -> tuple[list, float]:
    ref = results.get(ref_name)
    floor = 0.0
    rows = []
    for name in names:
        r = results.get(name)
        row = {"job": name, "status": r["status"] if r else "not run", "world": r["world"] if r else None}
        if r and r["status"] == "ok" and ref and ref["status"] == "ok":
            diff = differences(ref, r)
            row.update(diff or {})
            if name.endswith("1gpu_repeat") and diff:
                floor = diff["max_rel"]
        if r:
            row.update(summary=r.get("summary", {}), gpu_mem_used_gib=r.get("gpu_mem_used_gib"), error=r.get("error"))
        rows.append(row)
    # a layout agrees when it is as close to the one-GPU run as two one-GPU runs are (twice their drift),
    # or within tolerance_floor (bf16: reductions in another order; fp32 on CPU: 1e-4)
    tolerance = max(2 * floor, tolerance_floor)
    for row in rows:
        if "max_rel" in row:
            row["agrees"] = row["max_rel"] <= tolerance
    return rows, tolerance


def analyse(part: str, results: dict, plan: Plan) -> dict:
    cpu = plan.z.cpu
    names = [j.name for j in plan.jobs if j.part == part]
    if part == "parity":
        layouts = [n for n in names if n not in ("parity/init", "parity/1gpu")]
        rows, tol = parity_rows(results, layouts, "parity/1gpu", 1e-4 if cpu else 2e-3)
        ref = results.get("parity/1gpu")
        return {"reference": {"status": ref["status"] if ref else "not run", "summary": (ref or {}).get("summary"),
                              "gpu_mem_used_gib": (ref or {}).get("gpu_mem_used_gib"),
                              "lm_loss": [r["lm_loss"] for r in (ref or {}).get("records", [])]},
                "init_lm_loss": [r["lm_loss"] for r in results.get("parity/init", {}).get("records", [])],
                "layouts": rows, "tolerance": tol}
    if part == "preempt":
        return analyse_drill(results, plan)
    if part == "cp":
        parity = [n for n in names if "/parity_cp" in n and not n.endswith("cp1")]
        rows, tol = parity_rows(results, parity, "cp/parity_cp1", 1e-4 if cpu else 2e-3)
        speed = []
        for n in names:
            m = re.fullmatch(r"cp/speed_cp(\d+)_(\w+)", n)
            if m and n in results:
                r = results[n]
                speed.append({"job": n, "cp": int(m.group(1)), "T": m.group(2), "status": r["status"],
                              "summary": r.get("summary", {}), "gpu_mem_used_gib": r.get("gpu_mem_used_gib"),
                              "error": r.get("error")})
        return {"parity": rows, "tolerance": tol, "speed": speed}
    if part == "scaling":
        return analyse_scaling(results, names)
    raise ValueError(part)


def analyse_drill(results: dict, plan: Plan) -> dict:
    stopped, resumed, plain = (results.get(f"preempt/{n}") for n in ("stopped", "resumed", "uninterrupted"))
    out = {"layout": layout_text(plan.n, plan.drill_layout()),
           "jobs": {n: (results.get(f"preempt/{n}") or {}).get("status", "not run")
                    for n in ("prepare0", "prepare1", "stopped", "resumed", "uninterrupted")},
           "stopped": (stopped or {}).get("note", {}), "resumed": (resumed or {}).get("note", {}),
           "errors": {n: r["error"] for n in ("stopped", "resumed", "uninterrupted")
                      if (r := results.get(f"preempt/{n}")) and r.get("error")}}
    prepared = {}
    for i in (0, 1):
        meta = plan.work / "prepared" / f"site{i}.json"
        if meta.is_file():
            info = json.loads(meta.read_text())
            prepared[f"site{i}"] = {"documents": info.get("documents"), "tokens": info.get("tokens"),
                                    "sources": len(info.get("source", []))}
    out["prepared"] = prepared
    if resumed and plain and resumed["status"] == "ok" and plain["status"] == "ok":
        a, b = by_step(resumed), by_step(plain)
        steps = sorted(set(a) | set(b))
        differing = [s for s in steps
                     if s not in a or s not in b or any(a[s].get(k) != b[s].get(k) for k in DRILL_KEYS)]
        stop = out["stopped"].get("stop_step", 0)
        out.update(steps=len(steps), stop_step=stop, differing_steps=differing,
                   after_resume=[s for s in steps if s > stop],
                   identical_after_resume=not [s for s in differing if s > stop],
                   identical=not differing,
                   keys=[k for k in DRILL_KEYS if any(k in r for r in a.values())])
        if differing:
            s = differing[0]
            out["first_difference"] = {"step": s, "resumed": {k: a.get(s, {}).get(k) for k in DRILL_KEYS},
                                       "uninterrupted": {k: b.get(s, {}).get(k) for k in DRILL_KEYS}}
        out["validation"] = [{"step": s, "resumed": a[s].get("valid/lm_loss"),
                              "uninterrupted": b[s].get("valid/lm_loss"), "kl_resumed": a[s].get("valid/kl_loss"),
                              "kl_uninterrupted": b[s].get("valid/kl_loss")}
                             for s in steps if s in a and s in b and "valid/lm_loss" in b[s]]
        out["lm_loss"] = [{"step": s, "resumed": a[s]["lm_loss"], "uninterrupted": b[s]["lm_loss"],
                           "phase": b[s].get("phase")} for s in steps if s in a and s in b]
    return out


def analyse_scaling(results: dict, names: list[str]) -> dict:
    rows = {}
    for n in names:
        m = re.fullmatch(r"scaling/(\w+?)_(\w+)_(1gpu|dp\d+|cp\d+)", n)
        r = results.get(n)
        if not m or r is None:
            continue
        variant, T, where = m.groups()
        world = 1 if where == "1gpu" else int(where[2:])
        rows[n] = {"job": n, "variant": variant, "T": T, "mode": "-" if world == 1 else where[:2], "world": world,
                   "status": r["status"], "tok_s_gpu": r.get("summary", {}).get("tokens_per_s_per_gpu"),
                   "peak_mem_gib": r.get("summary", {}).get("peak_mem_gib"), "error": r.get("error")}
    for row in rows.values():
        if row["world"] == 1 or not row["tok_s_gpu"]:
            continue
        prev_where = "1gpu" if row["world"] == 2 else f"{row['mode']}{row['world'] // 2}"
        prev = rows.get(f"scaling/{row['variant']}_{row['T']}_{prev_where}")
        one = rows.get(f"scaling/{row['variant']}_{row['T']}_1gpu")
        if prev and prev["tok_s_gpu"]:
            row["efficiency_step"] = row["tok_s_gpu"] / prev["tok_s_gpu"]
        if one and one["tok_s_gpu"]:
            row["efficiency_vs_1gpu"] = row["tok_s_gpu"] / one["tok_s_gpu"]
    for row in rows.values():
        dense = rows.get(row["job"].replace(f"/{row['variant']}_", "/dense_"))
        if row["variant"] != "dense" and dense and dense["tok_s_gpu"] and row["tok_s_gpu"]:
            row["vs_dense"] = row["tok_s_gpu"] / dense["tok_s_gpu"]
    return {"rows": list(rows.values())}


def _f(value, spec: str = ".4f") -> str:
    return "" if value is None else format(value, spec)


def _mem(row: dict) -> str:
    """The largest nvidia-smi memory.used of any GPU of a job, GiB."""
    used = row.get("gpu_mem_used_gib")
    return f"{max(used.values()):.1f}" if used else ""


def _failed(row: dict, cells: int) -> str:
    return f"{row['status']}: {(row.get('error') or '')[:120]} |" + " |" * cells


def markdown(report: dict, plan: Plan) -> str:
    m, parts, jobs, call = report["machine"], report["parts"], report["jobs"], report["call"]
    lines = [f"# Multi-GPU runs (issue 38): {m['devices_text']}", "",
             f"{m['date']}, commit `{m['commit']}`, torch {m['torch']}; `{report['command']}`. This call: "
             f"{call['seconds']:.0f} s of a {call['budget']:.0f} s budget, {len(call['ran'])} job(s) ended, "
             f"{len(call['skipped'])} not started or cut."]
    lines += _md_results_rows(report, plan)
    sections = {"parity": _md_parity, "preempt": _md_drill, "cp": _md_cp, "scaling": _md_scaling}
    for part, section in sections.items():
        if part in parts:
            lines += section(parts[part], plan, jobs)
    for part, why in report.get("parts_skipped", {}).items():
        lines += ["", f"{part}: not run ({why})."]
    lines += ["", "## Jobs", "", "| job | status | GPUs | wall s | estimate s | error |", "|---|---|---|---|---|---|"]
    for name, r in jobs.items():
        gpus = ",".join(map(str, r.get("gpus") or [])) or "-"
        error = (r.get("error") or "").replace("|", "/")[:200]
        lines.append(f"| {name} | {r['status']} | {gpus} | {r.get('wall_s', '')} | {r.get('estimate_s', '')} | "
                     f"{error} |")
    for name, why in call["skipped"].items():
        lines.append(f"| {name} | not run in this call | | | | {why} |")
    lines += ["", "Each job's command (from the repository root; its log in the work directory starts with it):", ""]
    lines += [f"    {r['command']}" for r in jobs.values()]
    return "\n".join(lines) + "\n"


def _md_results_rows(report: dict, plan: Plan) -> list[str]:
    """The rows for bench/RESULTS.md (target | latest | status | measured | cmd), from what has run."""
    parts, m = report["parts"], report["machine"]
    when = f"{m['date'][:10]}, `{m['commit'].split()[0]}`"
    where = "processes" if plan.z.cpu else "GPUs"
    rows = []
    p = parts.get("parity")
    done = [r for r in (p or {}).get("layouts", []) if "max_rel" in r and not r["job"].endswith("repeat")]
    if done:
        worst = max(done, key=lambda r: r["max_rel"])
        repeat = next((r for r in p["layouts"] if r["job"].endswith("1gpu_repeat") and "max_rel" in r), None)
        speeds = ", ".join(f"{r['job'].split('/')[1]} {r['summary'].get('tokens_per_s_per_gpu', 0):,.0f}" for r in done)
        rows.append(f"| `{model_name(plan.z.model['parity'])}` layouts as the 109B recipes shard them = one GPU "
                    f"within {'fp32' if plan.z.cpu else 'bf16'} spread, "
                    f"{plan.args.steps} steps | largest relative lm difference {worst['max_rel']:.1e} "
                    f"({worst['job'].split('/')[1]}, step {worst['max_rel_step']}); one GPU twice: "
                    f"{_f((repeat or {}).get('max_rel'), '.1e') or '-'}; tok/s per GPU: {speeds} | "
                    f"{'met' if all(r.get('agrees') for r in done) else 'missed'} | {when} | M |")
    d = parts.get("preempt") or {}
    if "identical" in d:
        rows.append(f"| SIGUSR1 mid-run on {plan.n} {where} ({d['layout']}): every rank saves, the relaunch resumes "
                    f"bit-exactly | stopped after step {d['stop_step']}, steps {d['after_resume'][0]}-"
                    f"{d['after_resume'][-1]} {'identical' if d['identical_after_resume'] else 'DIFFER'} "
                    f"({len(d['keys'])} numbers a step) | {'met' if d['identical_after_resume'] else 'missed'} | "
                    f"{when} | M |")
        if d.get("validation"):
            last = d["validation"][-1]
            rows.append(f"| prepared-data blend with the validation loss on that layout | validation lm "
                        f"{last['uninterrupted']:.4f} at step {last['step']} | met | {when} | M |")
    elif d.get("errors"):
        rows.append(f"| SIGUSR1 mid-run on {plan.n} {where} | {'; '.join(d['errors'].values())[:200]} | failed | "
                    f"{when} | M |")
    c = parts.get("cp") or {}
    cps = [r for r in c.get("parity", []) if "max_rel" in r]
    if cps:
        rows.append(f"| CP {'/'.join(r['job'].rsplit('cp', 1)[1] for r in cps)} loss = CP 1 at "
                    f"{k_text(plan.z.cp_parity_seq)}, documents masked | largest relative lm difference "
                    f"{max(r['max_rel'] for r in cps):.1e} | "
                    f"{'met' if all(r.get('agrees') for r in cps) else 'missed'} | {when} | M |")
    speed = [r for r in c.get("speed", []) if r["cp"] > 1 and r["summary"].get("tokens_per_s")]
    if speed:
        rows.append(f"| `{model_name(plan.z.model['cp'])}` with CP, full recompute | " + ", ".join(
            f"CP {r['cp']} at {r['T']} {r['summary']['tokens_per_s']:,.0f} tok/s"
            + (f" ({r['summary']['peak_mem_gib']:.1f} GiB)" if "peak_mem_gib" in r["summary"] else "")
            for r in speed) + f" | | {when} | M |")
    s = parts.get("scaling") or {}
    ups = [r for r in s.get("rows", []) if r.get("efficiency_step") is not None]
    if ups:
        rows.append("| scaling, tok/s per GPU at 2n / at n | " + ", ".join(
            f"{r['variant']} {r['T']} {r['mode']}{r['world']} {r['efficiency_step']:.2f}" for r in ups)
            + f" | | {when} | M |")
    if not rows:
        return []
    return ["", "## For bench/RESULTS.md", "", "| target | latest | status | measured | cmd |",
            "|---|---|---|---|---|", *rows, "", f"    # M: {plan.n} {where}", f"    {report['command']}"]


def _md_parity(p: dict, plan: Plan, jobs: dict) -> list[str]:
    z, ref = plan.z, p["reference"]
    floor = "1e-4 (fp32)" if z.cpu else "2e-3 (bf16)"
    lines = ["", f"## Parity: {' '.join(z.model['parity'])}, MSA-PT sparse phase, {plan.args.steps} steps", "",
             f"{k_text(z.parity_seq)} context, {z.parity_batch} sequences a step (micro-batch {z.parity_micro}); "
             "every run loads the weights of one GPU after one step (`parity/init`, through init_from) and reads "
             "the same samples. Differences: the lm loss against the one-GPU run's, step by step, the largest over "
             f"the steps; a layout agrees when that is <= {p['tolerance']:.1e} (twice the one-GPU repeat's, at least "
             f"{floor}). Peak: rank 0's max_memory_allocated; used: nvidia-smi, the most of any of the job's GPUs.",
             "", "| layout | GPUs | lm step 1 | lm last step | max abs diff | max rel diff (step) | KL max rel | "
             "grad norm max rel | tok/s per GPU | peak GiB | used GiB | agrees |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lm, rs = ref.get("lm_loss") or [None], ref.get("summary") or {}
    lines.append(f"| 1 GPU (reference) | 1 | {_f(lm[0])} | {_f(lm[-1])} | | | | | "
                 f"{_f(rs.get('tokens_per_s_per_gpu'), ',.0f')} | {_f(rs.get('peak_mem_gib'), '.1f')} | "
                 f"{_mem(ref)} | |")
    for row in p["layouts"]:
        name = row["job"].split("/", 1)[1]
        what = "1 GPU again" if name == "1gpu_repeat" else layout_text(*LAYOUTS[name][:2])
        if "rows" not in row:
            lines.append(f"| {what} | {row['world'] or ''} | " + _failed(row, 9))
            continue
        s, steps = row.get("summary") or {}, row["rows"]
        lines.append(f"| {what} | {row['world']} | {_f(steps[0]['lm_loss'])} | {_f(steps[-1]['lm_loss'])} | "
                     f"{row['max_abs']:.2e} | {row['max_rel']:.2e} ({row['max_rel_step']}) | "
                     f"{_f(row.get('kl_loss_max_rel'), '.1e')} | {_f(row.get('grad_norm_max_rel'), '.1e')} | "
                     f"{_f(s.get('tokens_per_s_per_gpu'), ',.0f')} | {_f(s.get('peak_mem_gib'), '.1f')} | "
                     f"{_mem(row)} | {'yes' if row.get('agrees') else 'NO'} |")
    ok = [row for row in p["layouts"] if "rows" in row]
    if ok:
        names = [row["job"].split("/", 1)[1] for row in ok]
        lines += ["", "lm loss per step:", "", "| step | 1 GPU | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for i, first in enumerate(ok[0]["rows"]):
            cells = [_f(row["rows"][i]["lm_loss"]) if i < len(row["rows"]) else "" for row in ok]
            lines.append(f"| {first['step']} | {_f(first['ref'])} | " + " | ".join(cells) + " |")
    return lines


def _md_drill(d: dict, plan: Plan, jobs: dict) -> list[str]:
    z = plan.z
    data = ", ".join(f"{k} {v['documents']:,} documents, {v['tokens']:,} tokens" for k, v in d["prepared"].items())
    lines = ["", f"## Preemption drill and a prepared-data blend: {' '.join(z.model['preempt'])} on {plan.n} "
                 f"{'processes' if z.cpu else 'GPUs'}, {d['layout']}", "",
             f"{k_text(z.drill_seq)} context, {z.drill_batch} sequences a step, {z.drill_steps} steps, "
             f"trainer.deterministic=true, a checkpoint and the validation loss every {z.drill_interval} steps, the "
             f"indexer warmup for the first {z.drill_warmup_steps} steps; data: a 0.7 / 0.3 blend of two datasets "
             f"prepared with the byte tokenizer from slices of site-packages (data.split={z.drill_split}): {data}.",
             ""]
    st, again = d.get("stopped", {}), d.get("resumed", {})
    if "signal_after_step" in st:
        saved = (f"`{st['stop_line']}`; `latest` = {st.get('latest')}, shard files of ranks {st.get('ranks_saved')}, "
                 f"manifest {'written' if st.get('manifest') else 'MISSING'}") if "stop_step" in st else "no stop line"
        lines.append(f"- SIGUSR1 to the launcher and the {st.get('signalled', 1) - 1} processes it started, after step "
                     f"{st['signal_after_step']} (checkpoint {st.get('checkpoint_then')} existed); {saved}")
    if "resumed_at" in again:
        lines.append(f"- `launch.sh` relaunched it: resumed from {again['resumed_from']} at step {again['resumed_at']}")
    for n, err in d.get("errors", {}).items():
        lines.append(f"- {n}: FAILED: {err}")
    if "identical" not in d:
        return lines
    after = d["after_resume"] or ["-"]
    later = [s for s in d["differing_steps"] if s > d["stop_step"]]
    lines.append(f"- the steps after the resume ({after[0]}-{after[-1]}): "
                 + ("identical to the uninterrupted run's, bit for bit" if not later else f"DIFFER at steps {later}")
                 + f"; all {d['steps']} steps: "
                 + ("identical" if d["identical"] else f"differ at {d['differing_steps']}")
                 + f" (compared: {', '.join(d['keys'])})")
    if d.get("first_difference"):
        fd = d["first_difference"]
        lines.append(f"- first difference, step {fd['step']}: resumed {fd['resumed']}, uninterrupted "
                     f"{fd['uninterrupted']}")
    lines += ["", "| step | lm loss, stopped and resumed | lm loss, uninterrupted | phase | validation lm loss, "
                  "resumed / uninterrupted |", "|---|---|---|---|---|"]
    valid = {v["step"]: v for v in d.get("validation", [])}
    for row in d["lm_loss"]:
        v = valid.get(row["step"])
        mark = " (stop)" if row["step"] == d["stop_step"] else ""
        lines.append(f"| {row['step']}{mark} | {row['resumed']!r} | {row['uninterrupted']!r} | {row['phase']} | "
                     + (f"{v['resumed']!r} / {v['uninterrupted']!r}" if v else "") + " |")
    return lines


def _md_cp(c: dict, plan: Plan, jobs: dict) -> list[str]:
    z = plan.z
    lines = ["", f"## Context parallelism: {' '.join(z.model['cp'])}, MSA-PT, documents masked", "",
             f"Loss parity at {k_text(z.cp_parity_seq)} (2 sequences a step, {plan.args.steps} steps, one init's "
             f"weights) against CP 1; agrees: the largest relative lm difference <= {c['tolerance']:.1e}.", "",
             "| CP | max abs diff | max rel diff (step) | KL max rel | grad norm max rel | tok/s per GPU | agrees |",
             "|---|---|---|---|---|---|---|"]
    for row in c["parity"]:
        cp = row["job"].rsplit("cp", 1)[1]
        if "rows" not in row:
            lines.append(f"| {cp} | " + _failed(row, 5))
            continue
        lines.append(f"| {cp} | {row['max_abs']:.2e} | {row['max_rel']:.2e} ({row['max_rel_step']}) | "
                     f"{_f(row.get('kl_loss_max_rel'), '.1e')} | {_f(row.get('grad_norm_max_rel'), '.1e')} | "
                     f"{_f((row.get('summary') or {}).get('tokens_per_s_per_gpu'), ',.0f')} | "
                     f"{'yes' if row.get('agrees') else 'NO'} |")
    lines += ["", f"Long context, full recompute, one sequence a step, {z.speed_steps} steps (medians after the "
                  "first two):", "", "| T | CP | tok/s | tok/s per GPU | step s | peak GiB | used GiB | vs CP 1 |",
              "|---|---|---|---|---|---|---|---|"]
    base = {row["T"]: row["summary"].get("tokens_per_s") for row in c["speed"] if row["cp"] == 1}
    for row in sorted(c["speed"], key=lambda r: (len(r["T"]), r["T"], r["cp"])):
        s = row["summary"]
        if row["status"] != "ok" or not s.get("tokens_per_s"):
            lines.append(f"| {row['T']} | {row['cp']} | " + _failed(row, 5))
            continue
        ratio = f"{s['tokens_per_s'] / base[row['T']]:.2f}x" if base.get(row["T"]) and row["cp"] > 1 else ""
        lines.append(f"| {row['T']} | {row['cp']} | {s['tokens_per_s']:,.0f} | {s['tokens_per_s_per_gpu']:,.0f} | "
                     f"{s.get('step_ms', 0) / 1e3:.2f} | {_f(s.get('peak_mem_gib'), '.1f')} | {_mem(row)} | "
                     f"{ratio} |")
    return lines


def _md_scaling(sc: dict, plan: Plan, jobs: dict) -> list[str]:
    z = plan.z
    lines = ["", f"## Scaling: {' '.join(z.model['scaling'])}, dense vs MSA-PT (sparse phase), tokens/s per GPU", "",
             f"Data parallel: {z.scaling_tokens // 1024}K tokens a GPU a step; context parallel: CP = the GPU count, "
             "the one-GPU step's tokens. Doubling: tok/s per GPU at 2n / at n.", "",
             "| T | variant | mode | GPUs | tok/s per GPU | doubling | vs 1 GPU | MSA / dense | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = {"dense": 0, "pt": 1, "-": 0, "dp": 1, "cp": 2}
    for row in sorted(sc["rows"], key=lambda r: (len(r["T"]), r["T"], order.get(r["variant"], 2), order[r["mode"]],
                                                 r["world"])):
        head = f"| {row['T']} | {row['variant']} | {row['mode']} | {row['world']} | "
        if row["status"] != "ok" or not row["tok_s_gpu"]:
            lines.append(head + _failed(row, 4))
            continue
        ratio = f"{row['vs_dense']:.2f}x" if row.get("vs_dense") else ""
        lines.append(head + f"{row['tok_s_gpu']:,.0f} | {_f(row.get('efficiency_step'), '.2f')} | "
                     f"{_f(row.get('efficiency_vs_1gpu'), '.2f')} | {ratio} | {_f(row.get('peak_mem_gib'), '.1f')} |")
    return lines


def machine(n: int, cpu: bool) -> dict:
    """What the report says of the machine: GPUs, torch, the commit."""
    info = {"gpus": n, "cpu": cpu, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": os.uname().nodename}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = "?"
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    info["commit"] = (git.stdout.strip() or "unknown") + (" (with local changes)" if dirty.stdout.strip() else "")
    names = []
    if not cpu:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout
            names = [line.strip() for line in out.strip().splitlines()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    info["devices"] = names
    info["devices_text"] = (f"{n} gloo processes on the CPU ({info['cores']} cores)" if cpu else
                            f"{n} x {names[0] if names else 'GPU'}")
    return info
