"""Every check of a job that needs no process, run by the launcher before it starts any (and by each rank again):
the values (JobConfig.validate), then what reads files or builds the model's config: the path flags, the Hugging
Face directory, the data and its tokenizer, the model's fit to the split, the checkpoint to resume, the data's size.
Each refusal is one ValueError line naming the flag."""
import os

from tp.mesh import launched_by_torchrun

from ..config import GPTConfig
from ..hf import check_hf, check_safetensors
from ..stages import layers_per_stage
from . import data, destinations, documents, resuming, sinks
from .checkpoint_dirs import resume_path
from .config import JobConfig
from .config.fields import flag_of
from .model import check_compile, gpt_config_from_job


def check(job: JobConfig, world_size: int | None = None, *, config_file: str | None = None) -> GPTConfig:
    """The GPTConfig the job trains, once every check passed. Resolves job.parallelism.dp (from `world_size`,
    torchrun's WORLD_SIZE, when not given). `config_file`: the --config file the job was read from (an input)."""
    job.validate(world_size)
    sinks.check_packages(job)  # --tensorboard-dir, --wandb-project: their optional packages installed
    resuming.use_checkpoint_args(job)  # the checkpoint's tokenizer and data format, before they are checked
    destinations.check(job, config_file=config_file)  # every output: not an input, not foreign, writable
    if job.model.from_hf:
        try:
            check_safetensors(job.model.from_hf)  # (its weights whole)
        except ValueError as e:
            raise ValueError(f"--from-hf {job.model.from_hf}: {e}") from None
    plan = data.DataPlan.of(job)  # the data, resolved: each source's format, the tokenizer
    plan.check()  # --data / --tokenizer / --sft: paths, headers, schemas, text, a loadable tokenizer
    documents.check(job.data, plan.eod_id())  # --reset-attention-mask etc.: an end-of-document token to find them by
    config = gpt_config_from_job(job)
    if job.checkpoint.export_hf:  # (found at the save, after the training, otherwise)
        try:
            check_hf(config)
        except ValueError as e:  # (naming the flag that sets hf_model_type)
            why = str(e).replace(" fits)", " fits (--hf-model-type))")
            raise ValueError(f"--export-hf {job.checkpoint.export_hf}: {why}") from None
    check_model_fits(job, config)
    check_compile(job)  # --compile with what it cannot trace
    plan.check_vocab(config.vocab_size)
    check_resume(job, config)
    plan.check_sizes()  # (text: checked once the launcher has tokenized it, DataPlan.prepare)
    return config


def check_model_fits(job: JobConfig, config: GPTConfig) -> None:
    """The model split as the job asks: its positions cover --seq-len, its heads --tp, its layers the pipeline
    stages, and context parallelism its sequence."""
    parallel, seq_len = job.parallelism, job.training.seq_len
    limit = min(config.max_seq_len, config.sliding_window or config.max_seq_len)
    if seq_len > limit:  # (presets grow max_seq_len to --seq-len; a Hugging Face model's is its own)
        raise ValueError(f"--seq-len={seq_len} exceeds the model's max_seq_len={config.max_seq_len}"
                         + (f" / sliding_window={config.sliding_window}" if config.sliding_window else ""))
    config.check_tp(parallel.tp)
    layers_per_stage(config.num_layers, parallel.pp, parallel.virtual_stages, split=parallel.stage_split)
    check_experts(job, config)
    if parallel.cp > 1:
        try:
            config.check_cp(parallel.cp, parallel.tp)  # the a2a modes' head split
        except ValueError as e:
            raise ValueError(f"--cp-mode {parallel.cp_mode} with --cp={parallel.cp} --tp={parallel.tp}: {e}") from None
        try:
            config.check_seq_len(seq_len, tp=parallel.tp, cp=parallel.cp)
        except ValueError as e:
            raise ValueError(f"--seq-len={seq_len} with --cp={parallel.cp}"
                             + (f" --tp={parallel.tp} --sequence-parallel" if parallel.sequence_parallel else "")
                             + f": {e}") from None


def check_experts(job: JobConfig, config: GPTConfig) -> None:
    """A mixture of experts splits over --ep and --etp: experts by ep, each expert's FFN by etp, each tp rank's share
    of a micro-batch's tokens whole (without sequence parallelism the layer routes 1/tp of them per rank)."""
    parallel = job.parallelism
    etp = parallel.sizes["etp"]
    if not config.num_experts:
        if parallel.experts_apart:
            raise ValueError(f"--ep={parallel.ep} --etp={etp} split the experts of a mixture of experts, and the "
                             "model has none: give --num-experts E (or --model tiny-moe / small-moe)")
        given = [f"{flag_of(f)}={v}" for f, v in job.model.moe_fields().items() if f.startswith("moe_")]
        if given:  # (a dense model would train without them, silently)
            raise ValueError(f"{' '.join(given)} configure a mixture of experts, and the model has none: give "
                             "--num-experts E (or --model tiny-moe / small-moe)")
        return
    try:
        config.check_experts(parallel.ep, etp)
    except ValueError as e:
        raise ValueError(f"--ep={parallel.ep} --etp={etp}: {e}") from None


def check_resume(job: JobConfig, config: GPTConfig) -> None:
    """The checkpoint --load resumes (if any) is whole and holds this model, --steps goes beyond it, and --save's
    newest checkpoint is not later than the run's start (resuming.py)."""
    load, save = job.checkpoint.load, job.checkpoint.save
    path = resume_path(load, save)  # None: nothing to load (--save and --load the same, still empty)
    start = 0
    if path:
        from . import checkpoint

        try:
            if not launched_by_torchrun():  # (torchrun's ranks share the reading, in checkpoint.load)
                checkpoint.verify_files(path)  # every file's size and CRC-32, before a byte of it is used
            meta = checkpoint.read_meta(path)
        except ValueError as e:
            raise ValueError(f"--load {load}: {e}") from None
        resuming.check_model(job, meta["config"], config)
        start = resuming.start_step(job, meta["step"])
        restarted = os.path.realpath(save or "") == os.path.realpath(load)  # (the trainer says it is done)
        if job.training.steps <= start and not (job.evaluation.eval_only or restarted or job.checkpoint.export_hf):
            raise ValueError(f"--steps={job.training.steps} does not go beyond the checkpoint's step {start}: "
                             "nothing to train (with --export-hf: the checkpoint's model exported as it is)")
    resuming.check_save_forward(job, start)
