#!/usr/bin/env python3
"""Peer reference for RolloutPipe's GRPO: run TRL's GRPOTrainer on the CPU from the same SFT'd
model, task, reward and RL hyperparameters as a `rolloutpipe train` run, score both on the same
independent test set, and plot the two test-accuracy curves against steps and against rollouts.

Driven by scripts/rl/trl_compare.sh (which builds the model, the test set and our run); the
pieces:
  export-tokenizer: writes tokenizer.json (the character tokenizer as an HF tokenizer) into a
                    copy of the model directory, checked against the Rust tokenizer's ids;
  trl:              trains with GRPOTrainer, evaluating greedily on the test set;
  plot:             the side-by-side SVG from our metrics.jsonl and TRL's curve.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time

# The character vocabulary of harness/src/tasks/tokenizer.rs (ids fixed: checkpoints depend on it).
SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = "0123456789 +-*/=():>,.?abcdefghijklmnopqrstuvwxyz"


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({c: i + len(SPECIALS) for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # One token per character, spaces included; decoding concatenates (no separators).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    # A prompt is `<bos>` then its characters, as CharTokenizer::encode_prompt makes it.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    # Pinned against the Rust tokenizer's doctest: "12+3=" -> [4, 5, 14, 6, 18].
    ids = hf("12+3=")["input_ids"]
    assert ids == [1, 4, 5, 14, 6, 18], ids
    assert hf.decode([1, 4, 5, 2], skip_special_tokens=True) == "12"
    return hf


def export_tokenizer(src, dst):
    if os.path.exists(dst):
        sys.exit(f"{dst} exists; remove it or pick another --out")
    shutil.copytree(src, dst)
    build_tokenizer().save_pretrained(dst)
    print(f"model + tokenizer.json -> {dst}")


# --- the task, as harness/src/tasks/{arith,split}.rs define it -----------------------------

M64 = (1 << 64) - 1


def stable_hash(key):
    """FNV-1a + splitmix64 finalizer (split.rs); pinned values checked below."""
    h = 0xCBF29CE484222325
    for b in key.encode():
        h ^= b
        h = (h * 0x100000001B3) & M64
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & M64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & M64
    return h ^ (h >> 31)


assert stable_hash("") == 0xF52A15E9A9B5E89B and stable_hash("3+4") == 0xFF7279187858CA6F


def train_problems(n, digits, heldout_per_mille, seed, reverse, operands):
    """The training generator's distribution (`operands = "digits"`: digit count uniform in
    1..=digits, then the value; `"uniform"`: uniform in 0..10^digits), training split only.
    Python's RNG, not ChaCha8: the same distribution, not the same draws."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        ab = []
        for _ in range(2):
            if operands == "uniform":
                ab.append(rng.randrange(0, 10**digits))
                continue
            d = rng.randint(1, digits)
            lo = 0 if d == 1 else 10 ** (d - 1)
            ab.append(rng.randrange(lo, 10**d))
        a, b = ab
        key = f"{min(a, b)}+{max(a, b)}"
        if stable_hash(key) % 1000 >= heldout_per_mille:
            answer = str(a + b)
            out.append({"prompt": f"{a}+{b}=", "answer": answer[::-1] if reverse else answer})
    return out


def canonical_int(s):
    s = s.strip()
    neg = s.startswith("-")
    d = s[1:] if neg else s
    if not d or not all(c in "0123456789" for c in d):
        return None
    d = d.lstrip("0") or "0"
    return "-" + d if neg and d != "0" else d


# task.reverse: answers are written least-significant digit first; both are read back in order.
REVERSE = False


def is_correct(response, answer):
    if REVERSE:
        response, answer = response.strip()[::-1], answer.strip()[::-1]
    return canonical_int(response) is not None and canonical_int(response) == canonical_int(answer)


def reward_correct(completions, answer, **_):
    return [1.0 if is_correct(c, a) else 0.0 for c, a in zip(completions, answer)]


# --- TRL run ------------------------------------------------------------------------------


def greedy_accuracy(model, tok, problems, max_new, batch=500):
    import torch

    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(problems), batch):
            chunk = problems[i : i + batch]
            enc = tok([p["prompt"] for p in chunk], return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(
                **enc, max_new_tokens=max_new, do_sample=False, eos_token_id=2, pad_token_id=0
            )
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(is_correct(t, p["answer"]) for t, p in zip(texts, chunk))
    if was_training:
        model.train()
    return correct / len(problems)


def settings_from(config_path, a):
    """Our run's RL settings, mapped onto TRL's names; refuses what TRL cannot match."""
    import tomllib

    c = tomllib.load(open(config_path, "rb"))
    rl, task = c["rl"], c["task"]
    if task["name"] != "add" or task["jsonl"]:
        sys.exit("trl_compare supports the generated `add` task only")
    agg = {"token_mean": "dapo", "seq_mean": "grpo"}[rl["aggregation"]]
    std = {"sample": "group", "none": "none"}.get(rl["std"])
    if std is None:
        sys.exit(f"rl.std = {rl['std']!r} has no TRL equivalent (TRL's group scaling uses the sample std)")
    for k, v in dict(steps=c["run"]["steps"], batch_groups=rl["batch_groups"], group_size=rl["group_size"],
                     lr=rl["lr"], temperature=rl["temperature"], max_new_tokens=rl["max_new_tokens"],
                     eps_low=rl["eps_low"], eps_high=rl["eps_high"], beta=rl["beta"],
                     max_grad_norm=rl["max_grad_norm"], weight_decay=rl["weight_decay"],
                     top_k=rl["top_k"], top_p=rl["top_p"], opt_steps=rl["opt_steps"],
                     digits=task["digits"], heldout_per_mille=task["heldout_per_mille"],
                     seed=c["run"]["seed"], loss_type=agg, scale_rewards=std,
                     reverse=task.get("reverse", False),
                     operands=task.get("operands", "digits")).items():
        setattr(a, k, v)
    global REVERSE
    REVERSE = a.reverse


def run_trl(a):
    settings_from(a.config, a)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    test = [json.loads(l) for l in open(a.test)]
    train = train_problems(a.steps * a.batch_groups, a.digits, a.heldout_per_mille, a.seed, a.reverse, a.operands)
    curve = []
    rollouts_per_step = a.batch_groups * a.group_size
    t0 = time.time()

    class Eval(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            curve.append({"step": 0, "rollouts": 0, "test_accuracy": greedy_accuracy(model, tok, test, a.max_new_tokens)})
            print(json.dumps(curve[-1]), flush=True)

        def on_step_end(self, args, state, control, **kw):
            s = state.global_step
            if s % a.eval_every == 0 or s == a.steps:
                acc = greedy_accuracy(model, tok, test, a.max_new_tokens)
                curve.append({"step": s, "rollouts": s * rollouts_per_step, "test_accuracy": acc,
                              "elapsed_s": time.time() - t0})
                print(json.dumps(curve[-1]), flush=True)

    cfg = GRPOConfig(
        output_dir=os.path.join(a.out, "trl-run"),
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=a.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=a.max_grad_norm,  # 0 = off in both
        # One optimizer step per rollout of B prompts x G completions, like ours.
        per_device_train_batch_size=rollouts_per_step,
        gradient_accumulation_steps=1,
        num_generations=a.group_size,
        num_iterations=a.opt_steps,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        beta=a.beta,
        epsilon=a.eps_low,
        epsilon_high=a.eps_high,
        loss_type=a.loss_type,  # "dapo" = token mean over the step = our aggregation "token_mean"
        scale_rewards=a.scale_rewards,  # "group": (r - mean) / (std + eps), sample std = our "sample"
        shuffle_dataset=False,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=a.seed,
        remove_unused_columns=False,
        disable_dropout=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_correct,
        args=cfg,
        train_dataset=Dataset.from_list(train),
        processing_class=tok,
        callbacks=[Eval()],
    )
    trainer.train()
    with open(os.path.join(a.out, "trl_curve.json"), "w") as f:
        json.dump({"curve": curve, "wall_s": time.time() - t0, "config": vars(a)}, f, indent=1)
    print(f"TRL: test accuracy {curve[0]['test_accuracy']:.3f} -> {curve[-1]['test_accuracy']:.3f} "
          f"in {a.steps} steps, {time.time() - t0:.0f} s")


# --- plot ---------------------------------------------------------------------------------


def ours_curve(run_dir):
    """Test accuracy of our run per evaluated step; rollouts = responses generated so far
    (prompts drawn x G: filtered groups were generated too, so they count)."""
    import tomllib

    group_size = tomllib.load(open(os.path.join(run_dir, "config.toml"), "rb"))["rl"]["group_size"]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    pts = [{"step": 0, "rollouts": 0, "test_accuracy": summary["test_accuracy_start"]}]
    drawn = 0
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        m = json.loads(line)
        drawn += m["drawn"]
        if m.get("test_accuracy") is not None:
            pts.append({"step": m["step"] + 1, "rollouts": drawn * group_size, "test_accuracy": m["test_accuracy"]})
    return pts


def svg_panel(x0, series, key, xlabel, w=440, h=300):
    """One line chart as SVG elements, offset horizontally by x0."""
    left, top, pw, ph = x0 + 55, 35, w - 75, h - 85
    xmax = max(p[key] for _, _, pts in series for p in pts) or 1
    ymax = max(0.1, max(p["test_accuracy"] for _, _, pts in series for p in pts))
    ymax = math.ceil(ymax * 10) / 10
    el = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for i in range(6):
        y = top + ph - ph * i / 5
        el.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{ymax * i / 5:.2f}</text>')
        x = left + pw * i / 5
        el.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle" font-size="11">{xmax * i / 5:.0f}</text>')
    el.append(f'<text x="{left + pw / 2}" y="{top + ph + 34}" text-anchor="middle" font-size="12">{xlabel}</text>')
    el.append(f'<text x="{x0 + 14}" y="{top + ph / 2}" transform="rotate(-90 {x0 + 14} {top + ph / 2})" '
              f'text-anchor="middle" font-size="12">test accuracy (greedy)</text>')
    for j, (name, color, pts) in enumerate(series):
        d = " ".join(f"{left + pw * p[key] / xmax:.1f},{top + ph - ph * p['test_accuracy'] / ymax:.1f}" for p in pts)
        el.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        el.append(f'<text x="{left + 8}" y="{top + 16 + 15 * j}" font-size="12" fill="{color}">{name}</text>')
    return el


def plot(a):
    ours = ours_curve(a.ours)
    trl = json.load(open(a.trl))["curve"]
    series = [("RolloutPipe GRPO", "#1f77b4", ours), ("TRL GRPOTrainer", "#d62728", trl)]
    el = svg_panel(0, series, "step", "RL step") + svg_panel(440, series, "rollouts", "rollouts (responses generated)")
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="880" height="300" font-family="sans-serif">'
           f'<rect width="880" height="300" fill="white"/><text x="440" y="20" text-anchor="middle" font-size="14">'
           f'{a.title}</text>' + "".join(el) + "</svg>\n")
    with open(a.svg, "w") as f:
        f.write(svg)
    for name, _, pts in series:
        print(f"{name}: " + ", ".join(f"step {p['step']}: {p['test_accuracy']:.3f}" for p in pts))
    print(f"plot -> {a.svg}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-tokenizer")
    e.add_argument("--model", required=True)
    e.add_argument("--dst", required=True)
    t = sub.add_parser("trl")
    t.add_argument("--model", required=True, help="model dir with tokenizer.json (export-tokenizer)")
    t.add_argument("--test", required=True, help="test set JSONL (eval --uniform --write-problems)")
    t.add_argument("--out", required=True)
    t.add_argument("--config", required=True, help="our run's config.toml: every RL setting comes from it")
    t.add_argument("--eval-every", type=int, default=25)
    t.add_argument("--threads", type=int, default=2)
    q = sub.add_parser("plot")
    q.add_argument("--ours", required=True, help="our run directory")
    q.add_argument("--trl", required=True, help="trl_curve.json")
    q.add_argument("--svg", required=True)
    q.add_argument("--title", default="Test accuracy during GRPO: RolloutPipe vs TRL (same SFT model, task, hyperparameters)")
    a = p.parse_args()
    {"export-tokenizer": lambda: export_tokenizer(a.model, a.dst), "trl": lambda: run_trl(a), "plot": lambda: plot(a)}[a.cmd]()


if __name__ == "__main__":
    main()
