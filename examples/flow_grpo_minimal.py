"""Flow-GRPO in one file: the rollout, the rewards, the group advantages and the clipped update, written out.

Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv 2505.05470) fine-tunes a
flow-matching text-to-image model on a reward. Each iteration

1. draws P prompts and samples K images for each with an SDE that has the flow ODE's marginals (eq. 9), keeping every
   transition x_t -> x_{t+1} and its exact Gaussian log-prob;
2. scores the final images (here: their mean brightness, a reward that needs no model);
3. turns the rewards into group-relative advantages, the K images of a prompt being one group (eq. 5);
4. trains a LoRA on the PPO-clipped ratio of every transition (eq. 6), in a few minibatches of micro-batches.

Only the math layer of flowalign is used: the model adapter (``flowalign.load_flow_model``), the SDE step and its
log-prob (``flowalign.samplers``), the group advantages and the keyed random streams (``flowalign.seeding``). There is
no registry, config system or trainer. The defaults are the ``flow_grpo`` preset's golden run (tests/golden_runs.py:
the tiny SD3, 2 prompts x 2 images at 32 px, 10 steps, brightness, 2 minibatches), whose LoRA weights this file
reproduces bit for bit (tests/test_flow_grpo_minimal.py). The preset also keeps an EMA of the weights for evaluation
and has no KL term (its beta is 0): neither changes the trained weights, so both are left out here.

    python examples/flow_grpo_minimal.py                     # the tiny random SD3 of the tests, on CPU, in seconds
    python examples/flow_grpo_minimal.py --model /path/to/stable-diffusion-3.5-medium --image-size 512 \\
        --group-size 16 --batch-size 16 --lora-rank 32 --lora-alpha 64 --lr 3e-4 --iterations 100

Every random draw is keyed by what it is for, ``(seed, iteration, sample, purpose)``, so a sample's noise does not
depend on the batch it is drawn in (``flowalign.seeding``); that is also what lets this file match the trainer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import torch

import flowalign
from flowalign.advantages import group_advantages
from flowalign.samplers import ode_step, sde_step
from flowalign.seeding import Purpose, generator, numpy_rng

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    """The hyper-parameters; each is a command-line option (``--group-size 16``)."""

    model: str = "tiny"  # a diffusers pipeline directory or hub id; "tiny": the tests' tiny random SD3
    prompts: str = str(REPO / "assets/prompts/train.jsonl")  # JSONL, one {"prompt": ...} a line
    iterations: int = 2
    seed: int = 0
    prompts_per_iteration: int = 2  # P
    group_size: int = 2  # K images per prompt: one GRPO group
    batch_size: int = 2  # samples rolled out together (a chunk); a micro-batch is one chunk at one step
    image_size: int = 32
    num_steps: int = 10
    noise_level: float = 0.7  # a in the SDE's std_t = a sqrt(s / (1 - s)) (eq. 9)
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lr: float = 5e-4
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4  # PPO's epsilon (eq. 6): tiny, as the log-prob is a mean over latent dimensions
    advantage_clip: float = 5.0
    minibatches: int = 2  # optimizer steps per iteration, each on every trained step of a share of the chunks


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description="Flow-GRPO in one file (Liu et al. 2025, arXiv 2505.05470)")
    for f in fields(Args):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args(argv)))


# ------------------------------------------------------------------------------------------------------ 1. rollout
@torch.no_grad()
def rollout(model, cond, ids: torch.Tensor, sigmas: torch.Tensor, levels: list[float], args: Args, iteration: int):
    """Samples ``ids`` (numbered prompt-major: sample j belongs to prompt j // K) from noise to images.

    Step i draws x_{i+1} ~ N(mu(x_i, v), std^2) (eq. 9; ``sde_step`` holds the formulas) and keeps its log-prob
    log N(x_{i+1}; mu, std^2), averaged over the latent's dimensions; the last step is a plain Euler (ODE) step, since
    its std vanishes at sigma = 0. Returns the states [T + 1, B, ...] and the log-probs [T, B] (0 for ODE steps)."""
    x = model.prepare_noise(len(ids), args.image_size,
                            generator=[generator(args.seed, iteration, int(j), Purpose.INIT_NOISE) for j in ids])
    noise = [generator(args.seed, iteration, int(j), Purpose.SDE_NOISE) for j in ids]  # one stream per sample
    states, log_probs = [x], []
    for i, level in enumerate(levels):
        v = model.velocity(x, sigmas[i], cond)
        if level > 0:
            step = sde_step(x, v, sigmas[i], sigmas[i + 1], kind="flow_grpo", noise_level=level, generator=noise)
            x, log_prob = step.prev_sample, step.log_prob
        else:
            x, log_prob = ode_step(x, v, sigmas[i], sigmas[i + 1]), torch.zeros(len(ids))
        states.append(x)
        log_probs.append(log_prob)
    return torch.stack(states), torch.stack(log_probs)


# ------------------------------------------------------------------------------------------------------ 2. reward
def brightness(images: torch.Tensor) -> torch.Tensor:
    """The mean pixel intensity of each image in [0, 1]: a reward with variance on any model, random ones included."""
    return images.float().flatten(1).mean(dim=1)


# ------------------------------------------------------------------------------------------------ 4. clipped loss
def clipped_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                 clip_range: float) -> torch.Tensor:
    """Eq. 6: ratio_n = p_theta(x_{t+1} | x_t) / p_old(x_{t+1} | x_t) of each transition n, and
    L = mean_n -min(A_n ratio_n, A_n clip(ratio_n, 1 - eps, 1 + eps)): no gradient once a ratio leaves the trust
    region in the direction its advantage pushes."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return -torch.minimum(advantages * ratio, advantages * clipped).mean()


def micro_batch_loss(model, chunk: dict, step: int, sigmas: torch.Tensor, level: float, args: Args) -> torch.Tensor:
    """The clipped loss of one chunk's transitions at one step. The log-prob under the current policy is the same
    ``sde_step`` as the rollout's, scoring the stored x_{t+1} (``prev_sample``) instead of drawing one, so on the first
    micro-batch of an iteration the ratio is exactly 1."""
    x_t, x_next = chunk["states"][step], chunk["states"][step + 1]
    v = model.velocity(x_t, sigmas[step], chunk["cond"])  # with gradient, through the LoRA
    log_prob = sde_step(x_t, v, sigmas[step], sigmas[step + 1], kind="flow_grpo", noise_level=level,
                        prev_sample=x_next).log_prob
    # every transition of a trajectory gets its image's advantage
    return clipped_loss(log_prob, chunk["log_probs"][step], chunk["advantages"], args.clip_range)


def main(args: Args | None = None) -> dict[str, torch.Tensor]:
    """Train; returns the trained (LoRA) weights by parameter name."""
    args = args or parse_args()
    P, K, M = args.prompts_per_iteration, args.group_size, args.minibatches
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    num_chunks = -(-P * K // args.batch_size)
    if num_chunks % M:
        raise ValueError(f"--minibatches {M} must divide the {num_chunks} rollout chunks of an iteration "
                         f"(--prompts-per-iteration x --group-size / --batch-size)")

    # -- the policy: the base model frozen, a LoRA (A gaussian, B zero, so it starts as the base) trained in fp32
    with tempfile.TemporaryDirectory() as scratch:
        path = tiny_sd3(scratch) if args.model == "tiny" else args.model
        torch.manual_seed(args.seed)  # the LoRA's initialisation: the trainer seeds it the same way
        model = flowalign.load_flow_model(path)
    model.add_lora(rank=args.lora_rank, alpha=args.lora_alpha)
    model.freeze_base()
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.adam_eps,
                                  weight_decay=args.weight_decay)
    sigmas = model.sigmas(args.num_steps, args.image_size)  # the pipeline's (shifted) schedule, 1 -> 0
    levels = [args.noise_level] * (args.num_steps - 1) + [0.0]  # SDE on every step but the last
    trained_steps = [i for i, level in enumerate(levels) if level > 0]

    for iteration in range(args.iterations):
        # 1. rollout: P prompts (drawn with the iteration's own stream), K samples each, in chunks of batch_size
        rng = numpy_rng(args.seed, iteration, Purpose.PROMPTS)
        picked = [prompts[i] for i in rng.choice(len(prompts), size=P, replace=P > len(prompts))]
        cond = model.encode([entry["prompt"] for entry in picked])  # one row per prompt
        model.transformer.eval()
        chunks = []
        for ids in torch.arange(P * K).split(args.batch_size):
            chunk_cond = cond.index((ids // K).tolist())  # sample j is conditioned on prompt j // K
            states, log_probs = rollout(model, chunk_cond, ids, sigmas, levels, args, iteration)
            chunks.append({"ids": ids, "cond": chunk_cond, "states": states, "log_probs": log_probs})

        # 2. rewards of the final images
        with torch.no_grad():
            rewards = torch.cat([brightness(model.decode(chunk["states"][-1])) for chunk in chunks])

        # 3. group advantages (eq. 5): A_i = clip((r_i - mean_g r) / (std_g r + 1e-4), -5, 5) over the K images of
        #    the prompt of sample i, std_g the group's population std; a group whose rewards are all equal gets 0
        groups = torch.arange(P * K) // K
        advantages, stats = group_advantages(rewards, groups, std="group", clip=args.advantage_clip)
        print(f"iteration {iteration}: reward {rewards.mean():.4f} ± {rewards.std(unbiased=False):.4f}")
        if stats["zero_std_frac"] >= 1.0:  # no group ranks its samples: nothing to learn from this iteration
            continue
        for chunk in chunks:
            chunk["advantages"] = advantages[chunk["ids"]]

        # 4. the clipped update: the trained steps in a shuffled order; each minibatch (one optimizer step) takes
        #    every trained step of a share of the chunks, dealt by a keyed permutation per block of M chunks
        model.transformer.train()
        epoch = 0  # one pass over the rollout per iteration, as the preset takes
        order = torch.randperm(len(trained_steps), generator=generator(args.seed, iteration, epoch, Purpose.SHUFFLE))
        steps = [trained_steps[k] for k in order.tolist()]
        deal = generator(args.seed, iteration, epoch, Purpose.MINIBATCH_SHARES)
        owner = [m for _ in range(len(chunks) // M) for m in torch.randperm(M, generator=deal).tolist()]
        for m in range(M):
            micro_batches = [(chunk, step) for step in steps for chunk, o in zip(chunks, owner) if o == m]
            for chunk, step in micro_batches:  # the gradient is the mean over the minibatch's micro-batches
                loss = micro_batch_loss(model, chunk, step, sigmas, levels[step], args)
                (loss / len(micro_batches)).backward()
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.transformer.named_parameters() if p.requires_grad}


def tiny_sd3(directory: str) -> str:
    """The tiny random SD3 pipeline of the tests (seed 0, over the toy world's vocabulary), saved to ``directory``."""
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts

    train, test = split_prompts()
    words = sorted({word for entry in train + test for word in entry["prompt"].split()})
    tiny_sd3_pipeline(words, seed=0).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    main()
