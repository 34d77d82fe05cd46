"""Will a training config fit its GPUs? Per-process memory of ``flowalign train`` before anything loads
(``flowalign plan``).

The transformer is built on the meta device from its config (``flowalign.memory.published``: a shipped published
config, or a local directory's), with the run's LoRA attached by peft (on the meta device too), so every parameter
count is exact and no weight is read. Per process, in bytes (``W`` processes in a sharding group: all of them under
FSDP2, ``processes / distributed.replicate`` under HSDP, 1 under DDP, where every process holds everything):

* parameters: the frozen base in ``model.dtype`` (LoRA), or the fp32 master weights (full), ``/ W``;
* gradients and optimizer state: 4 and 8 bytes (AdamW's two moments) per trained parameter, ``/ W``; DDP keeps a
  second copy of the gradients in its all-reduce buckets with more than one process;
* the reference copy: a full fine-tune's frozen base in ``model.dtype``, ``/ W`` (sharded like the policy);
* the LoRA: its fp32 weights, ``/ W``;
* gathered blocks: FSDP2 all-gathers one block at a time and prefetches the next, and keeps the root unit (the
  parameters outside the blocks) gathered through the forward and backward: the two largest blocks and the root in
  the compute dtype;
* frozen components: the text encoders and the VAE in ``model.dtype``, whole on every process;
* activations: what one training forward of a micro-batch (``sampling.batch_size`` samples, twice that when the
  training forward runs classifier-free guidance) keeps for the backward, at the configured resolution and frames
  (``flowalign.memory.activations``: measured on a small model of the family, or on the model itself when it is a
  small local one, and scaled by tokens x width), with and without activation checkpointing, divided by the context
  parallel degree (each process holds 1/N of the sequence).

With ``distributed.cpu_offload`` (or ``model.reference_offload`` for the reference) the sharded parts live in host
memory instead. The verdict compares the total with the GPU's memory less a headroom (``HEADROOM``: the CUDA
context, the caching allocator's fragmentation and the collectives' buffers), and otherwise names the smallest change
that fits, trying one change at a time in this order, then the same changes together: activation checkpointing,
FSDP2, a smaller micro-batch, context parallelism, CPU offload, more GPUs per node, more nodes; a set of changes
that fits is then pruned, last to first, of every change the rest fit without (the cheaper ones stay).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

import torch

from flowalign.config import ConfigError
from flowalign.memory.activations import ActivationProfile, saved_activations
from flowalign.memory.published import ModelSpec, model_spec

__all__ = ["GIB", "HEADROOM", "Layout", "MemoryPlan", "Verdict", "describe", "layout_from_config", "lora_parameters",
           "model_counts", "plan", "plan_config", "verdict"]

GIB = 1024 ** 3
HEADROOM = 0.10  # of each GPU's memory, kept free (module docstring)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CALIBRATION_SIZE = 32  # pixels a side of the small model's measured forward
CALIBRATION_FRAMES = 5
SMALL_LOCAL_MODEL = 512 * 1024 ** 2  # bytes of weights under which a local model is measured itself


@dataclass
class Layout:
    """How the run is laid out and what it trains: the planner's inputs besides the model."""

    gpus: int = 1  # per node
    nodes: int = 1
    engine: str = "ddp"
    replicate: int = 1
    context_parallel: int = 1
    finetune: str = "lora"
    dtype: str = "bf16"
    compute: str = "bf16"
    lora_rank: int = 32
    lora_targets: list[str] | None = None
    lora_experts: list[str] | None = None
    checkpoint_every: int = 0  # 1 = every block (model.gradient_checkpointing)
    cpu_offload: bool = False
    reference_offload: bool = False
    micro_batch: int = 1  # samples per training forward, times cfg_passes
    cfg_passes: int = 1  # 2 when the training forward runs classifier-free guidance (batched)
    height: int = 512
    width: int = 512
    num_frames: int | None = None
    text_tokens: int | None = None

    @property
    def processes(self) -> int:
        return self.gpus * self.nodes

    @property
    def shards(self) -> int:
        return self.processes // self.replicate if self.engine == "fsdp2" else 1


@dataclass
class ModelCounts:
    """Exact parameter counts from the meta-device build."""

    parameters: int  # every transformer weight (both experts), the LoRA's included
    trained: int  # trained parameters (the LoRA, or every weight)
    lora: int
    largest_block: int
    root: int  # the parameters outside the blocks (the root FSDP unit: embeddings, output layer)
    block_kinds: list[str]  # the classes of one forward's blocks (the first expert's)
    width: int
    frozen: int


@dataclass
class MemoryPlan:
    """Bytes per process on the GPU and in host memory, by part."""

    layout: Layout
    model: str
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    activations_plain: int = 0
    activations_checkpointed: int = 0

    @property
    def total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


@dataclass
class Verdict:
    fits: bool
    capacity: int
    plan: MemoryPlan
    change: list[str] | None = None  # the overrides of the smallest change that fits (None: it fits, or none does)
    changed: MemoryPlan | None = None


def _meta_transformer(config: dict):
    import diffusers

    cls = getattr(diffusers, config.get("_class_name", ""), None)
    if cls is None:
        raise ConfigError(f"model.path: the transformer class {config.get('_class_name')!r} is not in diffusers",
                          key="model.path")
    with torch.device("meta"):
        return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def lora_parameters(transformer: torch.nn.Module, targets: list[str], rank: int) -> int:
    """The parameters a peft LoRA of ``rank`` on ``targets`` adds to ``transformer``: ``rank x (in + out)`` for every
    ``nn.Linear`` whose name is a target or ends with ``.target`` (peft's matching of ``target_modules``); counted
    without building the adapter (peft on a 14 B meta model takes seconds)."""
    total = 0
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (module.in_features + module.out_features)
    return total


_COUNTS: dict[tuple, "ModelCounts"] = {}


def model_counts(spec: ModelSpec, layout: Layout) -> ModelCounts:
    """Build every transformer of ``spec`` on the meta device and count, with the LoRA (the layout's targets, or the
    family's) on the trained experts (once per process for each model and adapter)."""
    key = (spec.name, str(spec.directory), layout.finetune, layout.lora_rank, tuple(layout.lora_targets or ()),
           tuple(layout.lora_experts or ()))
    if key not in _COUNTS:
        _COUNTS[key] = _model_counts(spec, layout)
    return _COUNTS[key]


def _model_counts(spec: ModelSpec, layout: Layout) -> ModelCounts:
    from flowalign.models.base import MODEL_FAMILIES
    from flowalign.models.blocks import transformer_blocks

    targets = list(layout.lora_targets or MODEL_FAMILIES.get(spec.family).lora_targets)
    experts = {"high": "transformer", "low": "transformer_2"}
    trained_names = ([experts[e] for e in layout.lora_experts] if layout.lora_experts else list(spec.transformers))
    parameters = lora = largest = root = 0
    kinds: list[str] = []
    width = 0
    for name, config in spec.transformers.items():
        transformer = _meta_transformer(config)
        blocks = transformer_blocks(transformer)
        if name == "transformer":
            kinds = [type(block).__name__ for block in blocks]
            width = config.get("num_attention_heads", 1) * config.get("attention_head_dim", 1)
        sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
        largest = max([largest, *sizes])
        whole = sum(p.numel() for p in transformer.parameters())
        root = max(root, whole - sum(sizes))
        parameters += whole
        if layout.finetune == "lora" and name in trained_names:
            lora += lora_parameters(transformer, targets, layout.lora_rank)
    trained = lora if layout.finetune == "lora" else parameters
    return ModelCounts(parameters + lora, trained, lora, largest, root, kinds, width, sum(spec.frozen.values()))


def _calibration_model(spec: ModelSpec, layout: Layout):
    """The small real model whose forward is measured: a small local model itself, else the family's tiny pipeline
    (``flowalign.models.tiny``), with the run's LoRA or every weight trainable."""
    from flowalign.models import tiny
    from flowalign.models.base import MODEL_FAMILIES
    from flowalign.models.loading import load_flow_model

    video = layout.num_frames is not None
    options = {"num_frames": CALIBRATION_FRAMES} if video else {}
    if spec.directory is not None and _weight_bytes(spec.directory) <= SMALL_LOCAL_MODEL:
        model = load_flow_model(spec.directory, family=spec.family, adapter_options=options or None)
    else:
        builder = getattr(tiny, f"tiny_{spec.family}_pipeline", None)
        if builder is None:
            raise ConfigError(f"model.family = {spec.family!r} has no small model to measure activations on",
                              key="model.family")
        model = MODEL_FAMILIES.get(spec.family)(builder(["a", "red", "circle"]), **options)
    if layout.finetune == "lora":
        model.add_lora(rank=layout.lora_rank, target_modules=layout.lora_targets)
        model.freeze_base()
    return model


def _weight_bytes(directory) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*.safetensors"))


def measured_profile(model, batch: int, size: int, num_frames: int | None = None) -> ActivationProfile:
    """The saved-for-backward profile of ``model`` (a ``FlowModel``) at ``batch`` samples of ``size`` pixels a side
    (and ``num_frames``: the model's own frame count), no guidance, one prompt's conditioning repeated."""
    generator = torch.Generator().manual_seed(0)
    shape = model.latent_shape(batch, size)
    x = torch.randn(shape, generator=generator, dtype=model.dtype)
    cond = model.encode(["a red circle"] * batch)
    return saved_activations(model, x, torch.tensor(0.5), cond)


_CALIBRATIONS: dict[tuple, ActivationProfile] = {}


def _calibrated(spec: ModelSpec, finetune: str, rank: int, targets: tuple[str, ...], video: bool, size: int
                ) -> ActivationProfile:
    """The small model's measured profile, once per process for each model and what trains (a few seconds each)."""
    key = (spec.name, str(spec.directory), spec.family, finetune, rank, targets, video, size)
    if key not in _CALIBRATIONS:
        layout = Layout(finetune=finetune, lora_rank=rank, lora_targets=list(targets) or None,
                        num_frames=CALIBRATION_FRAMES if video else None)
        model = _calibration_model(spec, layout)
        _CALIBRATIONS[key] = measured_profile(model, 1, size)
    return _CALIBRATIONS[key]


def activations(spec: ModelSpec, layout: Layout, counts: ModelCounts) -> tuple[int, int, int]:
    """``(plain, checkpointed, text tokens)``: the activation bytes of one micro-batch per process without and with
    checkpointing (every ``layout.checkpoint_every``-th block, or every block when that is 0), and the rule's text
    tokens."""
    frames = layout.num_frames
    size = min(CALIBRATION_SIZE, layout.height, layout.width)
    measured = _calibrated(spec, layout.finetune, layout.lora_rank, tuple(layout.lora_targets or ()),
                           frames is not None, size)
    ran = [b for b in measured.blocks if b.tokens]
    image = spec.image_tokens(size, size, CALIBRATION_FRAMES if frames else None) if spec.directory is not None else 0
    text = layout.text_tokens or spec.geometry.get("text_tokens") or max(ran[0].tokens - image, 0)
    tokens = spec.image_tokens(layout.height, layout.width, frames) + text
    itemsize = DTYPE_BYTES[layout.compute]
    scaled = measured.scaled(counts.block_kinds, batch=layout.micro_batch, tokens=tokens,
                             width=counts.width if spec.directory is None else ran[0].width, itemsize=itemsize)
    every = layout.checkpoint_every or 1
    cp = layout.context_parallel
    return math.ceil(scaled.total() / cp), math.ceil(scaled.total(every) / cp), text


def plan(spec: ModelSpec, layout: Layout, *, counts: ModelCounts | None = None,
         activation_bytes: tuple[int, int] | None = None) -> MemoryPlan:
    """The per-process memory of ``layout`` on ``spec`` (module docstring); ``counts`` and ``activation_bytes``
    (plain, checkpointed, at the layout's micro-batch and context parallel degree) may be given to skip their work."""
    counts = counts or model_counts(spec, layout)
    if activation_bytes is None:
        activation_bytes = activations(spec, layout, counts)[:2]
    plain, checkpointed = activation_bytes
    shards = layout.shards
    base = DTYPE_BYTES[layout.dtype]
    compute = DTYPE_BYTES[layout.compute]
    full = layout.finetune == "full"
    ddp_buckets = 2 if layout.engine == "ddp" and layout.processes > 1 else 1
    parts = {
        "parameters": (counts.parameters * 4 if full else (counts.parameters - counts.lora) * base) / shards,
        "gradients": counts.trained * 4 * ddp_buckets / shards,
        "optimizer state": counts.trained * 8 / shards,
        "reference copy": counts.parameters * base / shards if full else 0,
        "LoRA": 0 if full else counts.lora * 4 / shards,
    }
    offloaded = {"parameters", "gradients", "optimizer state", "LoRA"} if layout.cpu_offload else set()
    if layout.reference_offload or layout.cpu_offload:
        offloaded.add("reference copy")
    result = MemoryPlan(layout, spec.name, activations_plain=plain, activations_checkpointed=checkpointed)
    for part, value in parts.items():
        (result.host if part in offloaded else result.device)[part] = math.ceil(value)
    if layout.engine == "fsdp2":
        result.device["gathered blocks"] = (2 * counts.largest_block + counts.root) * compute
    result.device["text encoders and VAE"] = counts.frozen * base
    result.device["activations"] = checkpointed if layout.checkpoint_every else plain
    return result


def splits_sequence(spec: ModelSpec) -> bool:
    """Whether the family can run context-parallel (``FlowModel.context_parallel_plan`` of its transformer class is
    not None); a family that refuses it is never told to use it."""
    import diffusers

    from flowalign.models.base import MODEL_FAMILIES

    adapter = MODEL_FAMILIES.get(spec.family)
    transformer = getattr(diffusers, spec.transformers["transformer"].get("_class_name", ""), None)
    return adapter is not None and transformer is not None and adapter.context_parallel_plan(transformer) is not None


def _candidates(layout: Layout, max_gpus_per_node: int = 8, context_parallel: bool = True) -> list[tuple[str, dict]]:
    """The changes the verdict tries, cheapest first (module docstring), each with the override that makes it
    (context parallelism only for a family that can split its sequence: ``context_parallel``)."""
    changes = []
    if not layout.checkpoint_every:
        changes.append(("distributed.activation_checkpointing=1", {"checkpoint_every": 1}))
    if layout.engine != "fsdp2":
        changes.append(("distributed.engine=fsdp2", {"engine": "fsdp2"}))
    samples = layout.micro_batch // layout.cfg_passes
    while samples > 1:
        samples //= 2
        changes.append((f"sampling.batch_size={samples}", {"micro_batch": samples * layout.cfg_passes}))
    for degree in (2, 4, 8) if context_parallel else ():
        if layout.context_parallel < degree <= layout.processes and layout.processes % degree == 0:
            changes.append((f"--context-parallel {degree}", {"context_parallel": degree}))
            break
    if not layout.cpu_offload:
        changes.append(("distributed.cpu_offload=true" + ("" if layout.engine == "fsdp2" else
                                                           " distributed.engine=fsdp2"),
                        {"cpu_offload": True, "engine": "fsdp2"}))
    for gpus in (2 * layout.gpus, 4 * layout.gpus):
        if gpus <= max_gpus_per_node:
            changes.append((f"--gpus {gpus}", {"gpus": gpus}))
    for nodes in (2 * layout.nodes, 4 * layout.nodes):
        changes.append((f"--nodes {nodes}", {"nodes": nodes}))
    return changes


def verdict(spec: ModelSpec, layout: Layout, gpu_memory_gib: float, **options) -> Verdict:
    """The plan, whether it fits ``gpu_memory_gib`` less the headroom, and otherwise the smallest change that fits:
    one change at a time in the candidates' order, then the candidates accumulated in that order."""
    counts = model_counts(spec, layout)
    plain, checkpointed, text = activations(spec, replace(layout, micro_batch=1, context_parallel=1), counts)
    layout = replace(layout, text_tokens=text)

    def at(candidate: Layout) -> MemoryPlan:
        scale = candidate.micro_batch / candidate.context_parallel
        return plan(spec, candidate, counts=counts,
                    activation_bytes=(math.ceil(plain * scale), math.ceil(checkpointed * scale)))

    capacity = int(gpu_memory_gib * GIB * (1 - HEADROOM))
    current = at(layout)
    if current.total <= capacity:
        return Verdict(True, capacity, current)
    candidates = _candidates(layout, **{"context_parallel": splits_sequence(spec), **options})
    for override, change in candidates:
        candidate = at(replace(layout, **change))
        if candidate.total <= capacity:
            return Verdict(False, capacity, current, [override], candidate)
    def replay(chosen: list[tuple[str, dict]]) -> MemoryPlan:
        combined = layout
        for _, change in chosen:
            combined = replace(combined, **change)
        return at(combined)

    for count in range(2, len(candidates) + 1):
        chosen = candidates[:count]
        if replay(chosen).total <= capacity:  # then drop, last to first, each change the others fit without
            for entry in reversed(list(chosen)):
                fewer = [other for other in chosen if other is not entry]
                if fewer and replay(fewer).total <= capacity:
                    chosen = fewer
            overrides = list(dict.fromkeys(override for override, _ in chosen))
            return Verdict(False, capacity, current, overrides, replay(chosen))
    return Verdict(False, capacity, current)


def layout_from_config(config, gpus: int, nodes: int = 1, context_parallel: int = 1,
                       spec: ModelSpec | None = None) -> Layout:
    """The planner's layout of a ``TrainConfig`` at ``gpus`` per node on ``nodes`` nodes: the resolution and frames
    are ``sampling.image_size`` and ``sampling.num_frames`` (the published ones when null), the micro-batch
    of a rollout chunk (``sampling.batch_size``, or the whole local batch; ``check_batch`` at the data-parallel
    process count: the processes over the context parallel degree), doubled when the training forward runs
    classifier-free guidance."""
    from flowalign.models.base import MODEL_FAMILIES

    model, sampling, dist = config.model, config.sampling, config.distributed
    spec = spec or model_spec(model.path, model.family)
    published = spec.published
    size = sampling.image_size
    height, width = (size, size) if size else (published.get("height", 512), published.get("width", 512))
    adapter = MODEL_FAMILIES.get(spec.family)
    video = getattr(adapter, "modality", "image") == "video"
    frames = (sampling.num_frames or published.get("num_frames") or 5) if video else None
    cfg = sampling.guidance_scale > 1.0 and not _guidance_embedded(spec)
    samples = config.check_batch(max(1, gpus * nodes // context_parallel)).rollout_batch_size
    return Layout(
        gpus=gpus, nodes=nodes, engine=dist.engine, replicate=dist.replicate, context_parallel=context_parallel,
        finetune=model.finetune, dtype=model.dtype,
        compute=model.mixed_precision if model.mixed_precision != "no" else model.dtype,
        lora_rank=model.lora_rank, lora_targets=model.lora_targets, lora_experts=model.lora_experts,
        checkpoint_every=1 if model.gradient_checkpointing else dist.activation_checkpointing,
        cpu_offload=dist.cpu_offload, reference_offload=model.reference_offload,
        micro_batch=samples * (2 if cfg else 1), cfg_passes=2 if cfg else 1, height=height, width=width,
        num_frames=frames,
        text_tokens=model.max_sequence_length)


def _guidance_embedded(spec: ModelSpec) -> bool:
    return bool(spec.transformers["transformer"].get("guidance_embeds"))


def plan_config(config, *, gpus: int, gpu_memory_gib: float, nodes: int = 1,
                context_parallel: int | None = None) -> Verdict:
    """``flowalign plan``'s work: the verdict for a ``TrainConfig`` (bad numbers refused first, naming them).
    ``context_parallel`` None is the config's own degree (``distributed.context_parallel``: ulysses x ring)."""
    if context_parallel is None:
        context_parallel = config.distributed.context_parallel.degree
    for name, value in (("--gpus", gpus), ("--nodes", nodes), ("--context-parallel", context_parallel)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive whole number, got {value!r}", key=name)
    if not gpu_memory_gib > 0 or not math.isfinite(gpu_memory_gib):
        raise ConfigError(f"--gpu-memory must be a positive number of GiB, got {gpu_memory_gib!r}", key="--gpu-memory")
    spec = model_spec(config.model.path, config.model.family)
    processes = gpus * nodes
    if processes % config.distributed.replicate:
        raise ConfigError(f"distributed.replicate = {config.distributed.replicate} does not divide the {processes} "
                          "processes",
                          key="distributed.replicate")
    if processes % context_parallel:
        raise ConfigError(f"--context-parallel = {context_parallel} does not divide the {processes} processes",
                          key="--context-parallel")
    layout = layout_from_config(config, gpus, nodes, context_parallel, spec)
    return verdict(spec, layout, gpu_memory_gib)


def _gib(value: int) -> str:
    return f"{value / GIB:8.1f}"


def describe(result: Verdict) -> str:
    """The table and the verdict ``flowalign plan`` prints."""
    plan_, layout = result.plan, result.plan.layout
    engine = layout.engine if layout.replicate == 1 else f"fsdp2 (HSDP {layout.replicate} x {layout.shards})"
    what = f"LoRA r{layout.lora_rank}" if layout.finetune == "lora" else "full fine-tune"
    frames = f", {layout.num_frames} frames" if layout.num_frames else ""
    plural = "es" if layout.processes > 1 else ""
    lines = [f"{plan_.model}: {what}, {engine} over {layout.processes} process{plural} ({layout.gpus} GPUs x "
             f"{layout.nodes} node{'s' if layout.nodes > 1 else ''}), {layout.height}x{layout.width}{frames}, "
             f"micro-batch {layout.micro_batch} "
             f"(samples x CFG passes), {layout.compute} compute, context parallel {layout.context_parallel}",
             f"{'per process':42s} {'GPU GiB':>8s} {'host GiB':>8s}"]
    for part in ("parameters", "gradients", "optimizer state", "reference copy", "LoRA", "gathered blocks",
                 "text encoders and VAE"):
        if (part in plan_.device or part in plan_.host) and not (
                part == ("reference copy" if layout.finetune == "lora" else "LoRA")):
            on_host = part in plan_.host
            lines.append(f"{part:42s} {_gib(plan_.device.get(part, 0)) if not on_host else '       -'} "
                         f"{_gib(plan_.host[part]) if on_host else '       -'}")
    every = layout.checkpoint_every or 1
    checkpointing = "every block" if every == 1 else f"every {every}th block"
    marks = ("  <- this run", "") if not layout.checkpoint_every else ("", "  <- this run")
    lines.append(f"{'activations, no checkpointing':42s} {_gib(plan_.activations_plain)}{marks[0]}")
    lines.append(f"{'activations, checkpointing ' + checkpointing:42s} {_gib(plan_.activations_checkpointed)}"
                 f"{marks[1]}")
    lines.append(f"{'total':42s} {_gib(plan_.total)} {_gib(plan_.host_total)}")
    lines.append(f"capacity: {result.capacity / (1 - HEADROOM) / GIB:.0f} GiB less {HEADROOM:.0%} headroom = "
                 f"{result.capacity / GIB:.1f} GiB per GPU")
    if result.fits:
        lines.append(f"verdict: fits ({plan_.total / GIB:.1f} of {result.capacity / GIB:.1f} GiB)")
    elif result.change:
        lines.append(f"verdict: does not fit ({plan_.total / GIB:.1f} GiB > {result.capacity / GIB:.1f} GiB); the "
                     f"smallest change that fits: {' '.join(result.change)} -> {result.changed.total / GIB:.1f} GiB "
                     "per GPU")
    else:
        lines.append(f"verdict: does not fit ({plan_.total / GIB:.1f} GiB > {result.capacity / GIB:.1f} GiB), and no "
                     "change tried fits (checkpointing, FSDP2, a micro-batch of 1, context parallelism, CPU offload, "
                     "4x the GPUs per node up to 8, 4x the nodes)")
    return "\n".join(lines)
