"""Context parallelism (``distributed.context_parallel``): each sample's sequence split over a group of processes
through diffusers' ``enable_parallelism`` (Ulysses attention), on real processes with gloo on CPU.

Two launches (tests/context_parallel_worker.py through tests/forked_launch.py, the runs of
tests/context_parallel_runs.py) train: on 2 processes (data 1 x context 2), the tiny FLUX's LoRA under FSDP2 (one
iteration compared, then a second, checkpointed, the end-of-run evaluation, and a resume of the first checkpoint at
the same layout), the tiny Wan2.1's full fine-tune under DDP, one iteration of each other family with a diffusers
plan (Qwen-Image, FLUX.2, Wan2.2 A14B, Wan2.1 I2V, Wan2.2 A14B I2V) and of SkyReels-V2 T2V and I2V under flowalign's
plan; the tiny FLUX as data 2 x context 1 under DDP; then diffusers' ring attention over the 2
(tests/ring_attention.py); on 4 processes, the tiny FLUX as data 2 x context 2 under DDP and under HSDP. This
process trains the one-process runs and resumes the FSDP2 checkpoint on one process (another layout: DCP reshards).
The measured figures are in docs/guides/distributed.md (Context parallelism).

The config checks (before any model loads) run without processes, and so does the check over the family registry:
every family has a plan, or a refusal of its own that names what prevents one."""

from __future__ import annotations

import inspect
import json
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from context_parallel_runs import (METHOD, prompt_files, one_iteration, relative, settings, trainer_for,
                                   update_difference)
from flowalign.config import ConfigError, load_config
from flowalign.training.config import TrainConfig
from flowalign.training.context_parallel import check_context_parallel
from forked_launch import launch
from context_parallel_worker import train_runs
from test_fsdp2 import LORA_FILE, one_world_per_test  # noqa: F401 - a world of one per test

OFF = {"distributed.context_parallel.ulysses": 1}
# The collectives change the order of a few sums (the all-to-all's heads, the gradient reduction over 2 or 4
# processes): the rollouts agree to fp32 rounding (<= 1.4e-8 measured), the gradient norms to ~1e-7 (the second
# minibatch's gradient is taken at weights that already differ by rounding), and Adam (each update element divided by
# its own gradient's magnitude) turns that into a few 1e-6 of the update over the iteration's two steps (measured:
# docs/guides/distributed.md). The gradient norm is what pins the reduction over the context group: Adam's update is
# nearly blind to a gradient's scale, a gradient counted twice (or half) is a factor 2 in its norm.
# The loss is a mean of advantage-weighted ratios of order 1 that cancel to ~1e-5..1e-4: compared absolutely.
ROLLOUT_RTOL = 1e-5
# The families enabled after FLUX and Wan2.1 (one iteration each, LoRA under DDP, in the 2-process launch)
FAMILIES = ["qwen_image-cp2", "flux2-cp2", "wan22-cp2", "wan_i2v-cp2", "wan22_i2v-cp2", "skyreels_v2-cp2",
            "skyreels_v2_i2v-cp2"]
LOSS_ATOL = 1e-7
GRAD_NORM_RTOL = 1e-4
UPDATE_RTOL = 1e-3


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The tiny FLUX, Qwen-Image, FLUX.2, Wan2.1 T2V and I2V, Wan2.2 A14B T2V and I2V, SkyReels-V2 T2V and I2V,
    saved; the image-to-video prompts (``prompt_files``)."""
    from conftest import WORDS
    from flowalign.models.tiny import tiny_flux2_pipeline, tiny_flux_pipeline, tiny_qwen_image_pipeline
    from video_families import tiny_video_pipeline

    path = tmp_path_factory.mktemp("context-parallel")
    tiny_flux_pipeline(WORDS, seed=0).save_pretrained(path / "flux")
    tiny_qwen_image_pipeline(WORDS, seed=0).save_pretrained(path / "qwen_image")
    tiny_flux2_pipeline(WORDS, seed=0).save_pretrained(path / "flux2")
    for family in ("wan", "wan22", "wan_i2v", "wan22_i2v", "skyreels_v2", "skyreels_v2_i2v"):
        tiny_video_pipeline(family).save_pretrained(path / family)
    prompt_files(path)
    return path


@pytest.fixture(scope="module")
def launched(root, tmp_path_factory):
    """The two launches (module docstring); their figures under the returned folder."""
    out = tmp_path_factory.mktemp("context-parallel-runs")
    launch(2, train_runs, root, out, ["flux-cp2", "wan-cp2", "flux-d2", *FAMILIES, "ring"], log_dir=out / "launch-2")
    launch(4, train_runs, root, out, ["flux-d2-cp2", "flux-hsdp-cp2"], log_dir=out / "launch-4")
    return out


def assert_same_iteration(split: dict, whole: dict) -> None:
    print(f"log-probs {relative(split['log_probs'], whole['log_probs']):.1e}, rewards "
          f"{relative(split['rewards'], whole['rewards']):.1e}, loss {abs(float(split['loss'] - whole['loss'])):.1e}, "
          f"grad norm {relative(split['grad_norm'], whole['grad_norm']):.1e}, "
          f"update {update_difference(split, whole):.1e}")  # the guide's table (pytest -s)
    assert split["log_probs"].shape == whole["log_probs"].shape
    assert relative(split["log_probs"], whole["log_probs"]) < ROLLOUT_RTOL
    assert relative(split["rewards"], whole["rewards"]) < ROLLOUT_RTOL
    assert abs(float(split["loss"] - whole["loss"])) < LOSS_ATOL
    assert relative(split["grad_norm"], whole["grad_norm"]) < GRAD_NORM_RTOL
    assert update_difference(split, whole) < UPDATE_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux-cp2", "wan-cp2"])
def test_context_parallel_2_on_2_processes_equals_one_process(name, root, launched, tmp_path):
    """One training iteration with the sequence split over 2 processes equals the same iteration on one process (FLUX's
    LoRA under FSDP2, Wan2.1's full fine-tune, its reference copy split too, under DDP): the rollout's log-probs, the
    rewards, the loss, the gradient norm and the updated weights; the first ratio is exactly 1 (the
    rollout and the training forward run the same layout), and each process's blocks saw half the tokens."""
    split = load_file(str(launched / f"{name}.safetensors"))
    whole = one_iteration(trainer_for(root, name, tmp_path / "one", **OFF))
    assert bool(split["layout/parallel"]) and int(split["layout/block_tokens"]) * 2 == int(whole["layout/block_tokens"])
    assert float(split["first_ratio_max"]) == 1.0 and float(whole["first_ratio_max"]) == 1.0
    assert_same_iteration(split, whole)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_with_a_diffusers_plan_splits_exactly(name, root, launched, tmp_path):
    """Qwen-Image (its LoRA under DDP, which must find the last block's unused to_add_out), FLUX.2, Wan2.2 A14B
    (both experts split), Wan2.1 I2V (its CLIP image tokens join the text, which is not split), Wan2.2 A14B I2V (the
    first frame in the latents' channels), and SkyReels-V2 T2V and I2V (flowalign's plan in diffusers' format,
    ``skyreels_v2_plan``: diffusers ships none for its transformer), LoRAs under DDP:
    one iteration with context parallel 2 on 2 processes equals one process: rollout log-probs, rewards, loss,
    gradient norm, update; the first ratio is 1; each Wan2.2 expert's LoRA moved.
    Qwen-Image's text is as long as the batch's longest prompt: under the split every text the transformer was given
    is padded to an even length with masked tokens, while the one process saw odd lengths."""
    split = load_file(str(launched / f"{name}.safetensors"))
    whole = one_iteration(trainer_for(root, name, tmp_path / "one", **OFF))
    assert bool(split["layout/parallel"]) and int(split["layout/block_tokens"]) * 2 == int(whole["layout/block_tokens"])
    assert float(split["first_ratio_max"]) == 1.0 and float(whole["first_ratio_max"]) == 1.0
    assert_same_iteration(split, whole)
    if name == "qwen_image-cp2":  # its text cut to 11 tokens: padded to 12 under the split
        lengths = whole["layout/text_tokens"].tolist()
        assert any(n % 2 for n in lengths)
        assert split["layout/text_tokens"].tolist() == sorted({n + n % 2 for n in lengths})
    if name.startswith("wan22"):  # both experts trained (each LoRA moved)
        for expert in ("high", "low"):
            keys = [k for k in split if k.startswith(f"weight/{expert}.")]
            assert keys and any(not torch.equal(split[k], split["init/" + k[len("weight/"):]]) for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux-d2-cp2", "flux-hsdp-cp2"])
def test_data_2_x_context_2_on_4_processes_equals_data_2(name, launched):
    """4 processes as 2 data groups of 2 context processes train as 2 data-parallel processes: each data group takes
    its half of the batch with its keyed noise, and the gradient reduction counts each context group once; under DDP
    and under HSDP (FSDP2 with ``distributed.replicate: 2``: 2 copies, each sharded over one context group)."""
    four, two = (load_file(str(launched / f"{n}.safetensors")) for n in (name, "flux-d2"))
    assert int(four["layout/block_tokens"]) * 2 == int(two["layout/block_tokens"])
    assert float(four["first_ratio_max"]) == 1.0
    assert_same_iteration(four, two)


@pytest.mark.slow
def test_a_sharded_context_parallel_checkpoint_resumes_bitwise_and_reshards(root, launched, tmp_path):
    """FSDP2 with context parallel 2 on 2 processes: resuming the first checkpoint at the same layout gives bitwise
    the uninterrupted run's second checkpoint; resumed on one process without context parallelism (DCP reshards the
    2-process shards), the second iteration agrees with it to the collectives' rounding. Both then run the end-of-run
    evaluation (the split one with every forward split)."""
    run = launched / "flux-cp2"
    last = load_file(str(run / "checkpoint-000002" / LORA_FILE))
    resumed = load_file(str(launched / "flux-cp2-resumed" / "checkpoint-000002" / LORA_FILE))
    assert last.keys() == resumed.keys() and all(torch.equal(last[k], resumed[k]) for k in last)
    first = load_file(str(run / "checkpoint-000001" / LORA_FILE))
    trainer_for(root, "flux-cp2", tmp_path / "one", **OFF,
                **{"train.resume": str(run / "checkpoint-000001")}).train()
    one = load_file(str(tmp_path / "one" / "checkpoint-000002" / LORA_FILE))
    step = sum((last[k] - first[k]).double().pow(2).sum() for k in last).sqrt()
    assert float(sum((one[k] - last[k]).double().pow(2).sum() for k in last).sqrt() / step) < UPDATE_RTOL
    # the end-of-run evaluation ran under context parallelism too: the base model's images (before) are the one
    # process's to the 8-bit rounding of the grid, the trained model's (after) scored on as many images
    split_report, one_report = (json.loads((folder / "eval" / "before_after.json").read_text())
                                for folder in (run, tmp_path / "one"))
    assert split_report["before"] == one_report["before"] and split_report["samples"] == one_report["samples"]
    assert split_report["after"]["n_images"] == one_report["after"]["n_images"] == 2
    grids = [np.asarray(Image.open(folder / "eval" / "grid_before.png"), dtype=np.int16)
             for folder in (run, tmp_path / "one")]
    assert grids[0].shape == grids[1].shape and int(np.abs(grids[0] - grids[1]).max()) <= 1


@pytest.mark.slow
def test_ring_attention_runs_on_gloo_given_an_attention_op_with_its_log_sum_exp(launched):
    """The gap is the CPU attention backend, not gloo: diffusers' native backend refuses ring attention's
    ``return_lse``, while diffusers' ring (its all-gather forward, its permute backward, its merge of the chunks) over
    2 gloo processes with the textbook attention op (tests/ring_attention.py) equals one process's attention, output
    and gradients, to fp32 rounding (the ring merges in fp32: ``convert_to_fp32``)."""
    figures = load_file(str(launched / "ring.safetensors"))
    assert float(figures["ring/native_refused"]) == 1.0
    assert float(figures["ring/errors"].max()) < 1e-6


# ------------------------------------------------------------------------------------- the checks before loading
def config(root: Path, name: str = "flux-cp2", **extra) -> TrainConfig:
    return load_config(TrainConfig, METHOD, settings(root, name, root / "unused", **extra))


def test_degrees_are_at_least_one(root):
    with pytest.raises(ConfigError, match="distributed.context_parallel.ring must be >= 1") as caught:
        config(root, **{"distributed.context_parallel.ring": 0})
    assert caught.value.key == "distributed.context_parallel.ring"
    assert config(root).distributed.context_parallel.degree == 2
    assert config(root, **{"distributed.context_parallel.ring": 2}).distributed.context_parallel.degree == 4


def test_the_degree_must_divide_the_process_count(root):
    with pytest.raises(ConfigError, match="must divide the 3 processes") as caught:
        check_context_parallel(config(root), 3, "cpu")
    assert caught.value.key == "distributed.context_parallel.ulysses"
    layout = check_context_parallel(config(root), 4, "cpu")
    assert (layout.degree, layout.data_degree) == (2, 2)
    assert check_context_parallel(config(root, **OFF), 3, "cpu") is None


def test_a_launch_on_fewer_processes_than_the_degree_stops_before_the_model_loads(root, tmp_path):
    """Through the trainer: one process, ulysses 2 (the model path does not exist: nothing is loaded)."""
    from flowalign.training.trainer import Trainer

    cfg = config(root, **{"train.out_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="must divide the 1 processes"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_ring_attention_is_refused_on_cpu(root):
    with pytest.raises(ConfigError, match="log-sum-exp") as caught:
        check_context_parallel(config(root, **{"distributed.context_parallel.ulysses": 1,
                                               "distributed.context_parallel.ring": 2}), 2, "cpu")
    assert caught.value.key == "distributed.context_parallel.ring"


def test_ring_attention_on_a_gpu_needs_bf16_or_fp16(root):
    """On CUDA a ring runs on cuDNN's attention (it returns the log-sum-exp), which computes in bf16 or fp16."""
    ring = {"distributed.context_parallel.ulysses": 1, "distributed.context_parallel.ring": 2}
    with pytest.raises(ConfigError, match="model.mixed_precision: bf16") as caught:
        check_context_parallel(config(root, **ring), 2, "cuda")
    assert caught.value.key == "distributed.context_parallel.ring"
    assert check_context_parallel(config(root, **ring, **{"model.mixed_precision": "bf16"}), 2, "cuda").degree == 2


def test_ulysses_needs_the_heads_to_divide(root):
    """The tiny FLUX has 2 attention heads: Ulysses 4 cannot give each process a share."""
    with pytest.raises(ConfigError, match="2 attention heads"):
        check_context_parallel(config(root, **{"distributed.context_parallel.ulysses": 4}), 4, "cpu")


@pytest.mark.parametrize("name, extra, what", [
    ("flux-cp2", {"sampling.image_size": 36}, "image token sequence of 81 tokens"),
    ("flux-cp2", {"model.max_sequence_length": 11}, "text token sequence of 11 tokens"),
    ("wan-cp2", {"sampling.image_size": 24, "sampling.num_frames": 1}, "video token sequence of 9 tokens"),
    ("wan22-cp2", {"sampling.image_size": 24, "sampling.num_frames": 1}, "video token sequence of 9 tokens"),
    ("qwen_image-cp2", {"sampling.image_size": 24}, "image token sequence of 9 tokens"),
    ("flux2-cp2", {"sampling.image_size": 12}, "image token sequence of 9 tokens"),
    ("flux2-cp2", {"model.max_sequence_length": 11}, "text token sequence of 11 tokens"),
])
def test_every_split_sequence_must_divide_by_the_degree(root, name, extra, what):
    """FLUX splits its packed image tokens (36 px: 18 x 18 latents of the tiny VAE, 9 x 9 packed tokens) and its
    text tokens; Wan2.1 and Wan2.2 A14B their video tokens (one frame at 24 px: 6 x 6 latents in 2 x 2 patches);
    Qwen-Image and FLUX.2 their packed image tokens (3 x 3: 24 px through the tiny Qwen VAE's 4x, 12 px through the
    tiny FLUX.2 VAE's 2x, then 2 x 2 packing) and FLUX.2 its text (Qwen-Image's text is padded at each forward
    instead: test_every_family_with_a_diffusers_plan_splits_exactly)."""
    with pytest.raises(ConfigError, match=what):
        check_context_parallel(config(root, name, **extra), 2, "cpu")
    assert check_context_parallel(config(root, name), 2, "cpu").degree == 2


@pytest.mark.parametrize("family, reason", [
    ("sd3", "JointAttnProcessor2_0"),
    ("ltx_video", "per-head text mask"),
    ("ltx2", "audio tokens stay whole"),
])
def test_a_family_without_a_plan_is_refused_naming_it(family, reason, root, tmp_path):
    """SD3's joint attention calls scaled_dot_product_attention itself (no dispatcher, so no Ulysses or ring
    exchange): a plan cannot fix it. LTX-Video and LTX-2 have diffusers plans, but diffusers' Ulysses attention does
    not split the per-head text mask their processors build (and LTX-2's audio stays whole). The config says so
    before the model loads."""
    from conftest import WORDS
    from flowalign.models.tiny import tiny_sd3_pipeline
    from video_families import tiny_video_pipeline

    pipe = tiny_sd3_pipeline(WORDS, seed=0) if family == "sd3" else tiny_video_pipeline(family)
    pipe.save_pretrained(tmp_path / family)
    cfg = config(root, **{"model.path": str(tmp_path / family)})
    with pytest.raises(ConfigError, match=f"the {family} family cannot run context-parallel .*{reason}"):
        check_context_parallel(cfg, 2, "cpu")


# ------------------------------------------------------------------------------------- every family: a plan or why not
# The families that split their sequence: diffusers' plans (FLUX, FLUX.2 and Klein, Qwen-Image, the Wan2.1 / Wan2.2
# A14B families) and flowalign's (SkyReels-V2). A family that gains or loses a plan must show up here and in the guide.
PLANNED = {"flux", "flux2", "flux2_klein", "qwen_image", "wan", "wan22", "wan_i2v", "wan22_i2v", "skyreels_v2",
           "skyreels_v2_i2v"}
# The families refused after reading their transformer (this change), and a phrase of the reason each gives
REFUSED = {
    "chroma": "query-by-key mask over the joint text and image sequence",
    "hunyuan_video15": "HunyuanVideo15AttnProcessor2_0",
    "hunyuan_video15_i2v": "HunyuanVideo15AttnProcessor2_0",
    "z_image": "assembled inside the transformer's forward",
    "lumina2": "Lumina2AttnProcessor2_0",
    "cogview4": "CogView4AttnProcessor",
    "hidream": "HiDreamAttnProcessor",
    "sana": "linear attention",
    "sana_video": "linear attention",
    "mochi": "MochiAttnProcessor2_0",
    "kandinsky5_t2v": "fractal_flatten",
}


def family_transformer(adapter: type) -> type:
    """The diffusers transformer class of the family's pipeline, as the pipeline's signature annotates it (no model
    is built)."""
    import diffusers
    from diffusers import ModelMixin

    pipeline = getattr(diffusers, adapter.pipeline_class_name)
    annotation = inspect.signature(pipeline.__init__).parameters["transformer"].annotation
    annotation = getattr(diffusers, annotation) if isinstance(annotation, str) else annotation
    candidates = (annotation, *typing.get_args(annotation))  # X or X | None
    return next(c for c in candidates if isinstance(c, type) and issubclass(c, ModelMixin))


def test_every_registered_family_has_a_plan_or_a_refusal_of_its_own():
    """Over the whole family registry: a family whose transformer has a plan counts the tokens the plan splits
    (``context_parallel_lengths`` of its own, not the base's empty one); a family without one says why in a refusal
    of its own (not the base's default, which is for adapters registered from outside flowalign)."""
    from flowalign.models import MODEL_FAMILIES, FlowModel

    planned = set()
    for name in MODEL_FAMILIES:
        adapter = MODEL_FAMILIES.get(name)
        if adapter.context_parallel_plan(family_transformer(adapter)) is not None:
            planned.add(name)
            assert adapter.context_parallel_lengths.__func__ is not FlowModel.context_parallel_lengths.__func__, name
        else:
            assert adapter.context_parallel_refusal != FlowModel.context_parallel_refusal, name
    assert planned == PLANNED


def test_the_skyreels_plan_is_wans_in_diffusers_format():
    """SkyReels-V2's transformer is Wan's layout (``rope`` returns cos and sin ``[1, L, 1, d]``, the blocks take the
    tokens ``[B, L, D]``, ``proj_out`` ends them): flowalign's plan is diffusers' Wan plan without the per-token
    timestep entry, which only Wan2.2 TI2V uses."""
    from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel
    from flowalign.models.skyreels_v2 import SkyReelsV2Model

    plan = SkyReelsV2Model.context_parallel_plan(SkyReelsV2Transformer3DModel)
    wan = {k: v for k, v in WanTransformer3DModel._cp_plan.items() if k != ""}
    assert plan == wan
    assert SkyReelsV2Model.context_parallel_plan(WanTransformer3DModel) is None


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_family_whose_attention_cannot_split_is_refused_naming_it_and_why(family, root, tmp_path):
    """Before any model loads, from the transformer's config alone (its class): the ConfigError names the family and
    what prevents a plan (docs/guides/distributed.md, Context parallelism, has the table)."""
    from flowalign.models import MODEL_FAMILIES

    (tmp_path / "transformer").mkdir()
    cls = family_transformer(MODEL_FAMILIES.get(family))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": cls.__name__}))
    cfg = config(root, **{"model.path": str(tmp_path), "model.family": family})
    with pytest.raises(ConfigError, match=f"the {family} family cannot run context-parallel") as caught:
        check_context_parallel(cfg, 2, "cpu")
    assert REFUSED[family] in str(caught.value) and caught.value.key == "distributed.context_parallel"
