"""The one table of bad inputs: each override list with the start of its one-line message.

``preflight``: caught from the command line alone (``effitrain check`` and ``train.py`` before Hydra
starts, and ``validate`` inside a run). ``data``: found when the data is read, inside the job.
``{CSV}`` stands for the folder of CSV files that conftest's ``csv_files`` fixture writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

NO_CUDA = not torch.cuda.is_available()
HUB = ["data=hub", "data.load_args.path=csv"]
FILES = "+data.load_args.data_files={{train: {CSV}/{train}, test: {CSV}/{test}}}"


def files(train: str = "train.csv", test: str = "test.csv") -> str:
    return FILES.format(CSV="{CSV}", train=train, test=test)


# Rejected while the command line is read and composed: grammar, unknown options and keys, sweeps
# without -m, and values of the wrong type for the schema (effitrain/config/schema.py).
PARSE = [
    (["optimizer=sgd"], "optimizer='sgd' is not an option: choose one of adafactor, adam8bit, adamw"),
    (["backend=trainer,keras"], "backend='keras' is not an option: choose one of accelerator, trainer"),
    (["task=regression"], "task='regression' is not an option: choose one of causal_lm, classification"),
    (["lr_scheduler=step"], "lr_scheduler='step' is not an option: choose one of constant, cosine, linear"),
    (["optimizer.lrr=1e-3"], "optimizer.lrr='1e-3' is not a config key: did you mean optimizer.lr"),
    (["lr=1e-3"], "lr='1e-3' is not a config key: did you mean optimizer.lr?"),
    (["+lr=1e-3"], "lr='1e-3' adds a key nothing reads: did you mean optimizer.lr?"),
    (["optimizr=adamw"], "optimizr='adamw' is not a config key: did you mean optimizer=adamw?"),
    (
        ["optimizr=sgd"],
        "optimizr='sgd' is not a config key: did you mean optimizer (a config group: adafactor, adam8bit, adamw, adamw4bit, adamw_fused, apollo, lion)?",
    ),
    (["micro_batchsize=4"], "micro_batchsize='4' is not a config key: did you mean micro_batch_size"),
    (["a=[1,"], "'a=[1,' is not a valid override"),
    (["optimizer=adamw,adafactor"], "optimizer=adamw,adafactor is a sweep (several values): add -m"),
    # a deletion of a key every run reads (valid grammar; the run then failed on the missing key)
    (
        ["~seed"],
        "~seed is invalid: every run reads seed: give it a value instead (~ deletes only an argument of a _target_ node",
    ),
    (["~optimizer"], "~optimizer is invalid: every run reads optimizer: give it a value instead"),
    (["seed=x"], "seed='x' is invalid: must be an integer"),
    (["max_steps=1.5"], "max_steps=1.5 is invalid: must be an integer"),
    (["loss_chunks=x"], "loss_chunks='x' is invalid: must be an integer"),
    (
        ["activation_offloading=1kb"],
        "activation_offloading='1kb' is invalid: must be true, false or a minimum tensor size in bytes N >= 1",
    ),
    (
        ["activation_offloading=1.5"],
        "activation_offloading=1.5 is invalid: must be true, false or a minimum tensor size in bytes N >= 1",
    ),
    (["compile.mode=fast"], "compile.mode='fast' is invalid: choose one of default, reduce-overhead"),
    (["model.init=randm"], "model.init='randm' is invalid: choose one of pretrained, random"),
    (["model.trust_remote_code=maybe"], "model.trust_remote_code='maybe' is invalid: must be true or false"),
    (
        ["precision.mixed_precision=fp8"],
        "precision.mixed_precision='fp8' is invalid: choose one of no, fp16, bf16",
    ),
    (
        ["parallel=fsdp", "parallel.offload=maybe"],
        "parallel.offload='maybe' is invalid: must be true or false",
    ),
    (
        ["parallel=fsdp", "parallel.reshard_after_forward=zero3"],
        "parallel.reshard_after_forward='zero3' is invalid: must be true or false",
    ),
]

# Values a run rejects itself too (``validate``), before anything heavy is loaded.
VALUES = [
    (["gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 is invalid: must be an integer >= 1"),
    (["micro_batch_size=-2"], "micro_batch_size=-2 is invalid: must be an integer >= 1"),
    (["epochs=0"], "epochs=0 is invalid: must be an integer >= 1"),
    (["max_steps=0"], "max_steps=0 is invalid: must be an integer >= 1 (or null)"),
    (["max_length=1"], "max_length=1 is invalid: must be an integer >= 2"),
    (["max_length=1000"], "max_length=1000 is invalid: the model has 512 positions: give at most 512"),
    (["optimizer.lr=0"], "optimizer.lr=0 is invalid: must be a finite number > 0"),
    (["optimizer.lr=nan"], "optimizer.lr=nan is invalid: must be a finite number > 0"),
    (["optimizer.lr=inf"], "optimizer.lr=inf is invalid: must be a finite number > 0"),
    (["optimizer.betas=[0.9]"], "optimizer={'lr': 0.0002, 'betas': [0.9], 'eps': 1e-08} is invalid: AdamW rejects"),
    # APOLLO's settings first used at its first step: refused up front (each failed after loading)
    (["optimizer=apollo", "+optimizer.proj_type=colum"], "optimizer={'lr': 0.0002, 'betas': [0.9, 0.999], 'eps': 1e-06, 'rank': 32, 'scale': 12.0, 'scale_type': 'channel', 'update_proj_gap': 200, 'proj_type': 'colum'} is invalid: APOLLOAdamW rejects these arguments (proj_type must be std, reverse_std, right or left, got 'colum')"),
    (["optimizer=apollo", "optimizer.update_proj_gap=0"], "optimizer={'lr': 0.0002, 'betas': [0.9, 0.999], 'eps': 1e-06, 'rank': 32, 'scale': 12.0, 'scale_type': 'channel', 'update_proj_gap': 0} is invalid: APOLLOAdamW rejects these arguments (update_proj_gap must be an integer >= 1, got 0)"),
    (["optimizer=apollo", "+optimizer.proj_type=left"], "optimizer={'lr': 0.0002, 'betas': [0.9, 0.999], 'eps': 1e-06, 'rank': 32, 'scale': 12.0, 'scale_type': 'channel', 'update_proj_gap': 200, 'proj_type': 'left'} is invalid: APOLLOAdamW rejects these arguments (proj_type 'left' needs scale_type tensor (channel scaling works with std only))"),
    (["optimizer=apollo", "+optimizer.proj=svd"], "optimizer={'lr': 0.0002, 'betas': [0.9, 0.999], 'eps': 1e-06, 'rank': 32, 'scale': 12.0, 'scale_type': 'channel', 'update_proj_gap': 200, 'proj': 'svd'} is invalid: APOLLOAdamW rejects these arguments (proj must be random, got 'svd')"),
    (["+optimizer.bogus=1"], "optimizer.bogus=1 is invalid: AdamW takes no such argument: choose from lr, betas"),
    # every group's keys against its target's arguments (check_targets), named with the full key
    (["+data.num_trian=10"], "data.num_trian=10 is invalid: load_synthetic takes no such argument: choose from num_train, num_eval, num_labels, words_per_text, seed, min_words_per_text"),
    (["lr_scheduler=cosine", "+lr_scheduler.scheduler_kwargs={num_cycles: 2}"],
     "lr_scheduler.scheduler_kwargs={'num_cycles': 2} is invalid: get_scheduler takes no such argument: choose from name, scheduler_specific_kwargs"),
    (["+backend.gradient_accumulation=2"], "backend.gradient_accumulation=2 is invalid: fit takes no such argument: it takes none from the config"),
    (["task=causal_lm", "model=llama_tiny", "+task.pack=true"], "task.pack=true is invalid: CausalLM takes no such argument: choose from packing"),
    # a group's target comes from its allow-list, read from the name before anything is imported
    (["optimizer._target_=this.x"], "optimizer._target_='this.x' is invalid: optimizer takes a torch.optim.Optimizer class from torch.optim,"),
    (["lr_scheduler._target_=subprocess.run"], "lr_scheduler._target_='subprocess.run' is invalid: lr_scheduler takes a learning-rate scheduler class or function from"),
    (["data._target_=effitrain.train.data.shutil.rmtree"], "data._target_='effitrain.train.data.shutil.rmtree' is invalid: data takes a loader function, and this is not one"),
    (["optimizer._target_=torch.optim.lr_scheduler.LambdaLR"], "optimizer._target_='torch.optim.lr_scheduler.LambdaLR' is invalid: optimizer takes a torch.optim.Optimizer class, and this is not one"),
    # optimizer values that silently disable what they configure, or that the class asserts without a word
    (["optimizer=apollo", "optimizer.scale=0"], "optimizer.scale=0 is invalid: must be a finite number > 0 (it multiplies the projected update: 0 leaves every projected weight matrix unchanged"),
    (["optimizer=apollo", "optimizer.scale=-2.0"], "optimizer.scale=-2.0 is invalid: must be a finite number > 0"),
    (["optimizer=adafactor", "optimizer.clip_threshold=-1"], "optimizer.clip_threshold=-1 is invalid: must be a finite number > 0 (Adafactor divides an update by max(1, its RMS / clip_threshold)"),
    (["optimizer=adafactor", "optimizer.beta1=2.0"], "optimizer.beta1=2.0 is invalid: must be null (no first moment) or a number in [0, 1)"),
    (["optimizer=adam8bit", "optimizer.min_8bit_size=-1"], "optimizer.min_8bit_size=-1 is invalid: must be an integer >= 0"),
    (["optimizer=lion", "optimizer.betas=[0.9,1.5]"], "optimizer.betas=[0.9, 1.5] is invalid: must be two numbers in [0, 1]"),
    (["+lr_scheduler.num_warmup_steps=10"], "lr_scheduler.num_warmup_steps=10 is invalid: warmup_ratio decides it: give warmup_ratio instead"),
    (["warmup_ratio=1.0"], "warmup_ratio=1.0 is invalid: must be in [0, 1)"),
    (["max_grad_norm=-1"], "max_grad_norm=-1.0 is invalid: must be >= 0 (0 disables clipping)"),
    (["max_grad_norm=nan"], "max_grad_norm=nan is invalid: must be >= 0 (0 disables clipping)"),
    (["compile=on", "compile.backend=nonsense"], "compile.backend='nonsense' is invalid: choose one of"),
    (["model.name_or_path=/no/such/model"], "model.name_or_path='/no/such/model' is invalid: no such folder"),
    (["effective_batch_size=30", "gradient_accumulation_steps=4"],
     "effective_batch_size=30 is invalid: must be a multiple of gradient_accumulation_steps x processes = 4"),
    (["checkpoint_every=0"], "checkpoint_every=0 is invalid: must be an integer >= 1 (or null)"),
    # a switch takes true or false: OmegaConf would read 2, yes or on as true (and name the job's folder =2)
    (["parallel=fsdp", "parallel.reshard_after_forward=2"], "parallel.reshard_after_forward=2 is invalid: must be true or false"),
    (["parallel=fsdp", "parallel.offload=yes"], "parallel.offload='yes' is invalid: must be true or false"),
    (["progress_bar=on"], "progress_bar='on' is invalid: must be true or false"),
    (["gradient_checkpointing=0"], "gradient_checkpointing=0 is invalid: must be true, false or N >= 1 (recompute every N-th block)"),
    (["checkpoint_keep=0"], "checkpoint_keep=0 is invalid: must be an integer >= 1"),
    # chunked cross-entropy (effitrain/config/techniques/chunked_loss.py)
    (["task=causal_lm", "model=llama_tiny", "loss_chunks=0"],
     "loss_chunks=0 is invalid: must be an integer >= 1 (1: the whole logits at once; N: the LM head and loss over N chunks)"),
    (["loss_chunks=4"], "loss_chunks=4 is invalid: chunks split a causal LM's logits over positions: with task=classification give 1"),
    (["task=causal_lm", "model=llama_tiny", "max_length=32", "loss_chunks=32"],
     "loss_chunks=32 is invalid: at most the 31 target positions of a max_length=32 row (max_length - 1)"),
    (["resume=/no/such/checkpoint"], "resume='/no/such/checkpoint' is invalid: no such checkpoint folder"),
    (["data=hub"], "data.load_args.path='???' is invalid: a value is required"),
    # Hydra builds its callbacks itself, after the run's checks: held to an allow-list as the groups are
    (["+hydra.callbacks.x._target_=os.system"],
     "hydra.callbacks.x._target_='os.system' is invalid: hydra takes a Hydra callback class from hydra.experimental.callbacks, effitrain.sweep.report"),
    # a required argument deleted: the loader would fail after the model and tokenizer had loaded
    (["~data.seed"], "data.seed is missing: load_synthetic needs it (a deleted key, ~data.seed?): give data.seed=<value>"),
    (["data.num_eval=0"], "data.num_eval=0 is invalid: must be an integer >= 1"),
    (["data.num_labels=7"], "data.num_labels=7 is invalid: must be an integer between 2 and 6"),
    (["data.words_per_text=0"], "data.words_per_text=0 is invalid: must be an integer >= 1"),
    (["data.min_words_per_text=20"], "data.min_words_per_text=20 is invalid: must be at most words_per_text = 12"),
    (["seed=4294967296"], "seed=4294967296 is invalid: must be an integer in 0..4294967295"),
    (["model.init=pretrained"],
     "model.init='pretrained' is invalid: model.name_or_path='tiny-bert' has no weights here"),
    ([*HUB, files(test="missing.csv")], "data.load_args.data_files.test='{CSV}/missing.csv' is invalid: no such file"),
    ([*HUB, files(test="other_columns.csv")], "data.load_args.data_files='...' is invalid: the CSV files' columns differ"),
    ([*HUB, files(test="header_only.csv")], "data.load_args.data_files.test='{CSV}/header_only.csv' is invalid: the file holds no rows"),
    ([*HUB, files(), "data.text_column=body"], "data.text_column='body' is invalid: no such column: choose one of text, label"),
    ([*HUB, "+data.load_args.data_files={train: {CSV}, test: {CSV}/test.csv}"],
     "data.load_args.data_files.train='{CSV}' is invalid: {CSV} is a folder: give a file, or a glob such as {CSV}/*.csv"),
    (["task=causal_lm", "model=distilbert_base_cased"],
     "model='distilbert-base-cased' is invalid: task=causal_lm needs a model type that AutoModelForCausalLM builds; distilbert is not one"),
    (["model=tiny", "model.architecture.model_type=mpnet", "gradient_checkpointing=true"],
     "gradient_checkpointing=true is invalid: MPNetForSequenceClassification cannot recompute activations: give false"),
    (["task=causal_lm", "model=llama_tiny", "max_length=300"],
     "max_length=300 is invalid: the model has 256 positions: give at most 256"),
    (["task=causal_lm", *HUB, files(), "data.text_column=body"],
     "data.text_column='body' is invalid: no such column: choose one of text, label"),
    # what is named is what is built: an architecture node of another model is refused
    (["model.name_or_path=gpt2", "model.init=random"],
     "model.name_or_path='gpt2' is invalid: with model.init=random, model=tiny builds its own model.architecture (tiny-bert), not this model"),
    # task=causal_lm builds encoders as decoders; a type that stays bidirectional is refused
    (["task=causal_lm", "model=tiny", "model.architecture.model_type=xlm"],
     "model='tiny-bert' is invalid: task=causal_lm needs a causal model: XLMWithLMHeadModel lets position t see later tokens"),
    # model.config_overrides: every key a setting of the config class, none that is set elsewhere
    (["+model.config_overrides.bogus_key=1"], "model.config_overrides.bogus_key=1 is invalid: BertConfig has no such setting"),
    (["model.config_overrides.hiden_dropout_prob=0.0"],
     "model.config_overrides.hiden_dropout_prob=0.0 is invalid: BertConfig has no such setting: did you mean hidden_dropout_prob"),
    # a suggestion never names a key refused below; an architecture's key is named where it is set
    (["task=causal_lm", "+model.config_overrides.is_decoderr=true"],
     "model.config_overrides.is_decoderr=true is invalid: BertConfig has no such setting: did you mean is_encoder_decoder?"),
    (["+model.config_overrides.hidden_sizes=3"],
     "model.config_overrides.hidden_sizes=3 is invalid: BertConfig has no such setting: did you mean "
     "model.architecture.hidden_size or hidden_act or output_hidden_states?"),
    (["+model.config_overrides.num_labels=5"],
     "model.config_overrides.num_labels=5 is invalid: the data's label column decides the number of classes: leave it out"),
    (["+model.config_overrides.hidden_size=64"],
     "model.config_overrides.hidden_size=64 is invalid: model.architecture.hidden_size=32 sets it too: give it in one place"),
    (["model.config_overrides.vocab_size=100"],
     "model.config_overrides.vocab_size=100 is invalid: a random model's embedding is sized to its tokenizer"),
    (["task=causal_lm", "model=llama_tiny", "model.config_overrides.is_decoder=false"],
     "model.config_overrides.is_decoder=false is invalid: task=causal_lm builds every model as a decoder"),
    # values the model class refuses when it is built: built on meta up front
    (["model.config_overrides.hidden_dropout_prob=5"],
     "model.config_overrides.hidden_dropout_prob=5 is invalid: BertForSequenceClassification cannot be built with it (dropout probability has to be between 0 and 1, but got 5)"),
    (["model.architecture.num_attention_heads=5"],
     "model.architecture.num_attention_heads=5 is invalid: BertForSequenceClassification cannot be built with it (The hidden size (32) is not a multiple of the number of attention heads (5))"),
    (["+model.config_overrides.layer_norm_eps=abc"],
     "model.config_overrides.layer_norm_eps='abc' is invalid: BertForSequenceClassification cannot be built with it (Validation error for field 'layer_norm_eps'"),
    # an explicit micro batch that the effective batch contradicts
    (["effective_batch_size=32", "micro_batch_size=4"],
     "micro_batch_size=4 is invalid: effective_batch_size=32 with gradient_accumulation_steps x processes = 1 sets it to 32"),
    # adapters: peft's LoraConfig values, checked before a model loads (train/adapters/build.py)
    (["adapter=lora", "adapter.r=0"], "adapter.r=0 is invalid: must be an integer >= 1 (the rank of each update)"),
    (["adapter=dora", "adapter.lora_alpha=0"], "adapter.lora_alpha=0 is invalid: must be a number > 0"),
    (["adapter=lora", "adapter.lora_dropout=1"], "adapter.lora_dropout=1 is invalid: must be in [0, 1)"),
    (["adapter=qlora", "adapter.lora_dropout=-0.1"], "adapter.lora_dropout=-0.1 is invalid: must be in [0, 1)"),
    (["adapter=lora", "adapter.lr=0"], "adapter.lr=0 is invalid: must be a finite number > 0 (or null)"),
    (["adapter=lora", "adapter.target_modules=[q_proj]"],
     "adapter.target_modules=['q_proj'] is invalid: matches no module of BertForSequenceClassification: give "
     "all-linear or names it has, such as dense, key, query, value"),
    # a suggestion never names what is refused: the head trains in full, so it takes no adapter
    (["adapter=lora", "adapter.target_modules=[classifier]"],
     "adapter.target_modules=['classifier'] is invalid: classifier is in the head of BertForSequenceClassification, "
     "which trains in full: give all-linear or names it has, such as dense, key, query, value"),
    (["adapter=lora", "adapter.target_modules=[LayerNorm]"],
     "adapter.target_modules=['LayerNorm'] is invalid: peft cannot wrap it: Target module LayerNorm((32,), "
     "eps=1e-12, elementwise_affine=True, bias=True) is not supported"),
    (["adapter=lora", "+adapter.task_type=CAUSAL_LM"],
     "adapter.task_type='CAUSAL_LM' is invalid: the task decides it (SEQ_CLS or CAUSAL_LM): leave it out"),
    (["adapter=qlora", "+adapter.quantization.bnb_4bit_compute_dtype=float16"],
     "adapter.quantization.bnb_4bit_compute_dtype='float16' is invalid: precision decides it"),
    pytest.param(["precision=fp16"], "precision='fp16' is invalid: fp16 needs a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA present")),
    pytest.param(["optimizer._target_=bitsandbytes.optim.PagedAdamW8bit"],
                 "optimizer._target_='bitsandbytes.optim.PagedAdamW8bit' is invalid: paged optimizers need a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA present")),
    # FSDP2 sharding (effitrain/config/parallel.py): each measured, docs/sharding.md
    (["parallel.offload=true"], "parallel.offload=true is invalid: it is FSDP's: use parallel=fsdp"),
    (["parallel=fsdp", "backend=trainer"],
     "parallel='fsdp' is invalid: backend=trainer shards through its own fsdp arguments"),
    (["parallel=fsdp", "compile=on"], "compile='on' is invalid: with parallel=fsdp the sharded model is not compiled"),
    (["parallel=fsdp", "optimizer=adam8bit"],
     "optimizer='adam8bit' is invalid: with parallel=fsdp: its update mixes plain tensors"),
    (["parallel=fsdp", "optimizer=adafactor"],
     "optimizer='adafactor' is invalid: with parallel=fsdp: its update mixes"),
    # APOLLO's random projection multiplies a plain matrix with the sharded gradient (every matrix
    # with both sides above its rank; the tiny model's have none: the 7B-shaped replay found it)
    (["parallel=fsdp", "adapter=lora"],
     "adapter='lora' is invalid: with parallel=fsdp an adapted model is not sharded"),
    (["parallel=fsdp", "optimizer=apollo"],
     "optimizer='apollo' is invalid: with parallel=fsdp: its update mixes"),
    # activation offloading (effitrain/config/techniques/offloading.py): a size in bytes, not with compile or FSDP
    (["activation_offloading=0"],
     "activation_offloading=0 is invalid: must be true, false or a minimum tensor size in bytes N >= 1"),
    (["activation_offloading=true", "compile=on"],
     "activation_offloading=true is invalid: torch.compile is not run under its hooks: give false or compile=off"),
    (["activation_offloading=4096", "parallel=fsdp"],
     "activation_offloading=4096 is invalid: parallel=fsdp's per-rank prediction does not count the host copies: give false"),
    # the optimizer step in backward (effitrain/config/techniques/in_backward.py): where it cannot run
    (["optimizer_in_backward=2"], "optimizer_in_backward=2 is invalid: must be true or false"),
    (["optimizer_in_backward=true"],  # the default max_grad_norm=1.0 clips: the user gives 0
     "max_grad_norm=1.0 is invalid: with optimizer_in_backward=true each gradient is applied and freed in backward, before the global norm could clip it: give max_grad_norm=0 (no clipping), or optimizer_in_backward=false"),
    (["optimizer_in_backward=true", "max_grad_norm=0", "gradient_accumulation_steps=2"],
     "gradient_accumulation_steps=2 is invalid: with optimizer_in_backward=true each gradient updates its parameter as backward makes it, so none accumulates over micro-batches: give 1"),
    (["optimizer_in_backward=true", "max_grad_norm=0", "backend=trainer"],
     "backend='trainer' is invalid: with optimizer_in_backward=true: the Trainer steps, clips and scales the optimizer in its own loop; use backend=accelerator"),
    (["optimizer_in_backward=true", "max_grad_norm=0", "parallel=fsdp"],
     "parallel='fsdp' is invalid: with optimizer_in_backward=true: FSDP reduces each gradient after backward made it"),
    pytest.param(["optimizer_in_backward=true", "max_grad_norm=0", "precision=fp16"],
                 "precision='fp16' is invalid: with optimizer_in_backward=true: fp16's grad scaler unscales",
                 marks=pytest.mark.skipif(NO_CUDA, reason="without CUDA fp16 is refused first")),
]  # fmt: skip

PREFLIGHT = PARSE + VALUES


def every_nth_fast(rows: list, n: int) -> list:
    """``rows`` as pytest params, every ``n``-th (from the first) in the fast selection and the
    others marked slow, so the full suite still runs them all; a row that is already a
    ``pytest.param`` keeps its marks and id."""
    params = [row if hasattr(row, "marks") else pytest.param(*row) for row in rows]
    return [
        row if i % n == 0 else pytest.param(*row.values, marks=[*row.marks, pytest.mark.slow], id=row.id)
        for i, row in enumerate(params)
    ]


# Found only when the data is read (inside the job, before the model is built).
DATA = [
    ([*HUB, files(train="empty_text.csv")],
     "data.text_column (train split, row 3 of a CSV)='text' is invalid: the text is empty: every sample needs one"),
    ([*HUB, files(), "data.eval_split=validation"], "data.eval_split='validation' is invalid: no such split"),
    (
        [*HUB, files(test="bad_label.csv")],
        "data.label_column='label' is invalid: integer labels must be the class ids 0..1 with none unused (unused: none; smallest: -1)",
    ),
    ([*HUB, files(test="other_labels.csv")],
     "data.load_args.data_files='...' is invalid: the files do not read as one dataset (ArrowInvalid: Failed to parse string: 'no' as a scalar of type int64)"),
    ([*HUB, files(train="names.csv", test="other_names.csv")],
     "data.label_column='label' is invalid: the eval split holds labels the train split lacks ('bad', 'good'; train has 'neg', 'pos')"),
    ([*HUB, files(test="new_classes.csv")],
     "data.label_column='label' is invalid: the eval split holds labels the train split lacks (2, 3; train has 0, 1)"),
    ([*HUB, files(train="half_label.csv")],
     "data.label_column='label' is invalid: a numeric label column must hold whole class ids; it holds 0.5"),
    ([*HUB, files(train="id_or_name.csv")],
     "data.label_column='label' is invalid: the column mixes class ids ('0', '1') with other values ('x')"),
    ([*HUB, files(train="one_class.csv")],
     "data.label_column='label' is invalid: the train split holds a single class (1): classification needs at least 2"),
]  # fmt: skip


def fill(overrides: list[str], message: str, folder: Path) -> tuple[list[str], str]:
    """The table's row with ``{CSV}`` replaced by the folder the fixture wrote."""
    return [o.replace("{CSV}", str(folder)) for o in overrides], message.replace("{CSV}", str(folder))
