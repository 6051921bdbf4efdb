"""The rules between settings of several sections: combinations that cannot work fail before any work, naming the
flags."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, model_validator

from relax.algorithms import ALGORITHM_SPECS
from relax.config.base import CRITIC_FIELDS, OPD_FIELDS, flag

# The settings of an engine the run builds (`relax.core.engines.embedded.core_settings`): with only servers the run
# does not start they have nothing to act on.
ENGINE_SETTINGS = ("engine_core", "mem_fraction_static", "max_total_tokens", "max_prefill_tokens", "page_size",
                   "cuda_graph_max_bs", "disable_cuda_graph")


class CrossSectionRules(BaseModel):
    """Checked after every section's own rules."""

    @model_validator(mode="after")
    def _check_combinations(self) -> Self:
        spec = ALGORITHM_SPECS[self.advantage_estimator]
        self._check_critic_and_distillation(spec)
        if self.loss_type == "policy_loss" and self.n_samples_per_prompt < spec.min_group_size:
            raise ValueError(
                f"{flag('advantage_estimator')} {spec.name} needs {flag('n_samples_per_prompt')} >= "
                f"{spec.min_group_size}, got {self.n_samples_per_prompt}"
            )
        samples_per_step = self.samples_per_step
        if self.global_batch_size is not None and samples_per_step % self.global_batch_size:
            raise ValueError(
                f"{flag('global_batch_size')} ({self.global_batch_size}) must divide {flag('rollout_batch_size')} x "
                f"{flag('n_samples_per_prompt')} ({samples_per_step})"
            )
        self._check_dynamic_batch_size()
        if self.changed("heartbeat_timeout_s") and not self.use_health_check:
            raise ValueError(f"{flag('heartbeat_timeout_s')} needs {flag('use_health_check')}")
        if self.changed("metrics_service_port") and not self.use_metrics_service:
            raise ValueError(f"{flag('metrics_service_port')} needs {flag('use_metrics_service')}")
        if not self.use_dynamic_batch_size and self.train_batch_size % self.micro_batch_size:
            raise ValueError(
                f"{flag('micro_batch_size')} ({self.micro_batch_size}) must divide the global batch size "
                f"({self.train_batch_size})"
            )
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            raise ValueError(
                f"{flag('kl_coef')} (KL in the reward) and {flag('kl_loss_coef')} (KL in the loss) are exclusive; "
                "set one of them to 0"
            )
        if self.kl_coef > 0 and not spec.uses_reward_kl:
            raise ValueError(
                f"{flag('kl_coef')} has no effect with {flag('advantage_estimator')} {spec.name}; "
                "use reinforce_plus_plus or --use-kl-loss"
            )
        if spec.requires_on_policy_updates and self.steps_per_rollout != 1:
            raise ValueError(
                f"{flag('advantage_estimator')} {spec.name} needs one optimizer step per rollout: "
                f"{flag('global_batch_size')} ({self.global_batch_size}) must equal {flag('rollout_batch_size')} x "
                f"{flag('n_samples_per_prompt')} ({samples_per_step})"
            )
        if (self.calculate_per_token_loss and self.loss_agg_mode is not None
                and self.loss_agg_mode != "token-mean"):
            raise ValueError(
                f"{flag('calculate_per_token_loss')} means {flag('loss_agg_mode')} token-mean, "
                f"but {flag('loss_agg_mode')} is {self.loss_agg_mode}; set only one of them"
            )
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(
                f"{flag('tis_clip_low')} ({self.tis_clip_low}) is above {flag('tis_clip')} ({self.tis_clip})"
            )
        if self.rm_type and not self.trains_on_dataset and not self.label_key:
            raise ValueError(f"{flag('rm_type')} {self.rm_type} compares every response with a label: set "
                             f"{flag('label_key')}")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            raise ValueError(f"{flag('kl_loss_coef')} > 0 has no effect without {flag('use_kl_loss')}")
        if self.rollout_top_k == 0 or self.rollout_top_k < -1:
            raise ValueError(f"{flag('rollout_top_k')} must be -1 (off) or a positive number, got {self.rollout_top_k}")
        if self.eval_interval is not None and not self.eval_prompt_data:
            raise ValueError(f"{flag('eval_interval')} needs {flag('eval_prompt_data')}")
        if self.system_prompt and not self.apply_chat_template:
            raise ValueError(f"{flag('system_prompt')} needs {flag('apply_chat_template')}")
        if self.overlong_buffer_len is not None and self.overlong_buffer_len > self.rollout_max_response_len:
            raise ValueError(
                f"{flag('overlong_buffer_len')} ({self.overlong_buffer_len}) is above "
                f"{flag('rollout_max_response_len')} ({self.rollout_max_response_len})"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"{flag('min_lr')} ({self.min_lr}) is above {flag('lr')} ({self.lr})")
        if self.context_parallel_size > 1 and not self.sequence_packing:
            raise ValueError(f"{flag('context_parallel_size')} splits packed rows: drop --no-sequence-packing")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(f"{flag('sequence_parallel')} splits the tokens over the tensor-parallel ranks: it needs "
                             f"{flag('tensor_model_parallel_size')} > 1")
        if self.sequence_parallel and not self.sequence_packing:
            raise ValueError(f"{flag('sequence_parallel')} splits packed rows: drop --no-sequence-packing")
        if self.pipeline_model_parallel_size > 1 and not self.sequence_packing:
            raise ValueError(f"{flag('pipeline_model_parallel_size')} runs packed micro-batches: drop "
                             "--no-sequence-packing")
        split = [flag(n) for n in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
                 if getattr(self, n) is not None]
        if split and self.pipeline_model_parallel_size == 1:
            raise ValueError(f"{', '.join(split)} {'needs' if len(split) == 1 else 'need'} "
                             f"{flag('pipeline_model_parallel_size')} > 1")
        if self.expert_model_parallel_size > 1 and not self.moe_grouped_gemm:
            raise ValueError(f"{flag('expert_model_parallel_size')} runs the experts as grouped GEMMs: drop "
                             "--no-moe-grouped-gemm")
        return self

    def _check_offload(self, asynchronous: bool) -> None:
        asked = [flag(n) for n in ("offload", "offload_train", "offload_rollout") if getattr(self, n)]
        if not asked:
            return
        if self.trains_on_dataset:
            raise ValueError(f"{', '.join(asked)}: {flag('loss_type')} {self.loss_type} has no rollout phase to "
                             "offload around")
        if self.placement != "in_process":
            raise ValueError(f"{', '.join(asked)}: offloading between phases needs the in-process placement (the "
                             f"roles share the device in one process); drop them with {flag('placement')} ray")
        if asynchronous:
            raise ValueError(f"{', '.join(asked)}: the async modes overlap rollout and training, so there is no "
                             "idle phase to offload; drop them or use the sync mode")
        if self.resolved_offload_rollout and not self._embedded_rollout:
            raise ValueError(f"{flag('offload_rollout')} (also set by {flag('offload')}) frees the embedded engine's "
                             f"memory; with {flag('rollout_external')} or {flag('rollout_api_port')} rollout runs "
                             "elsewhere or on engines added at any time: pass --no-offload-rollout")

    def _check_dynamic_batch_size(self) -> None:
        if not self.use_dynamic_batch_size:
            set_budget = [flag(n) for n in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu") if self.changed(n)]
            if set_budget:
                raise ValueError(f"{', '.join(set_budget)} need {flag('use_dynamic_batch_size')}")
            return
        if self.max_tokens_per_gpu is None:
            raise ValueError(f"{flag('use_dynamic_batch_size')} needs {flag('max_tokens_per_gpu')}")
        if self.changed("micro_batch_size"):
            raise ValueError(f"{flag('use_dynamic_batch_size')} sizes micro-batches by tokens: drop "
                             f"{flag('micro_batch_size')}")
        longest = self.rollout_max_context_len or (
            self.rollout_max_prompt_len + self.rollout_max_response_len if self.rollout_max_prompt_len else None)
        for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
            budget = getattr(self, name)
            if budget is not None and longest is not None and budget < longest:
                raise ValueError(f"{flag(name)} ({budget}) must hold the longest sample ({longest} tokens: "
                                 "--rollout-max-context-len, or --rollout-max-prompt-len + "
                                 "--rollout-max-response-len)")

    def _check_critic_and_distillation(self, spec) -> None:
        set_critic = [flag(name) for name in CRITIC_FIELDS if self.changed(name)]
        if set_critic and not spec.needs_critic:
            raise ValueError(
                f"PPO critic options ({', '.join(set_critic)}) need {flag('advantage_estimator')} ppo, "
                f"not {spec.name}"
            )
        set_opd = [flag(name) for name in OPD_FIELDS if self.changed(name)]
        if set_opd and not self.use_opd:
            raise ValueError(f"distillation options ({', '.join(set_opd)}) need {flag('use_opd')}")
        if self.use_opd:
            if not self.teacher_hf_checkpoint:
                raise ValueError(f"{flag('use_opd')} needs {flag('teacher_hf_checkpoint')}")
            if self.opd_loss_coef > 0 and "opd_kl_coef" not in self.model_fields_set:
                self.opd_kl_coef = 0.0  # naming only the loss coefficient selects the loss mode
            if (self.opd_kl_coef > 0) == (self.opd_loss_coef > 0):
                raise ValueError(
                    f"on-policy distillation runs in one mode: set exactly one of {flag('opd_kl_coef')} (advantage "
                    f"mode, now {self.opd_kl_coef}) and {flag('opd_loss_coef')} (loss mode, now {self.opd_loss_coef})"
                )
        if self.multimodal_keys:
            unknown = sorted(set(self.multimodal_keys) - {"image", "video", "audio"})
            if unknown:
                raise ValueError(f"{flag('multimodal_keys')}: unknown media type(s) {unknown}; use image, video, audio")
            if not self.apply_chat_template:
                raise ValueError(f"{flag('multimodal_keys')} needs {flag('apply_chat_template')}: the chat template "
                                 "renders each media item as the model's placeholder tokens")
            if self.trains_on_dataset:
                raise ValueError(f"{flag('loss_type')} {self.loss_type} does not take {flag('multimodal_keys')} yet")
        if self.use_audio_in_video and "video" not in (self.multimodal_keys or {}):
            raise ValueError(f"{flag('use_audio_in_video')} gives each video its sound track: it needs video in "
                             f"{flag('multimodal_keys')}")
        if self.image_min_token_num > self.image_max_token_num:
            raise ValueError(f"{flag('image_min_token_num')} is above {flag('image_max_token_num')}")
        self._check_mode(spec)
        if self.trains_on_dataset and self.use_opd:
            raise ValueError(f"{flag('loss_type')} {self.loss_type} trains on dataset responses; it cannot use "
                             f"{flag('use_opd')}")
        if self.trains_on_pairs and self.train_batch_size != self.samples_per_step:
            raise ValueError(f"{flag('loss_type')} {self.loss_type} trains each step's pairs in one optimizer step "
                             "(the loss's per-completion gradients are taken at the step's parameters): "
                             f"{flag('global_batch_size')} must be 2 x {flag('rollout_batch_size')} = "
                             f"{self.samples_per_step} or unset, got {self.global_batch_size}")
        self._check_reward_model()

    def _check_reward_model(self) -> None:
        """The preference losses' settings only where they apply; --loss-type rm's layouts; the held-out grader."""
        for loss_type, names in (("rm", ("margin_key", "center_rewards_coefficient")),
                                 ("dpo", ("dpo_loss", "dpo_beta", "dpo_label_smoothing", "simpo_gamma"))):
            given = [flag(name) for name in names if self.changed(name)]
            if given and self.loss_type != loss_type:
                raise ValueError(f"{', '.join(given)}: settings of {flag('loss_type')} {loss_type}, which this run "
                                 f"is not ({flag('loss_type')} {self.loss_type})")
        if self.loss_type == "rm":
            layouts = {flag("lora_rank"): self.lora_rank, flag("tensor_model_parallel_size"):
                       self.tensor_model_parallel_size > 1, flag("pipeline_model_parallel_size"):
                       self.pipeline_model_parallel_size > 1}
            refused = [name for name, given in layouts.items() if given]
            if refused:
                raise ValueError(f"{flag('loss_type')} rm with {', '.join(refused)} is not built yet (the score head "
                                 "would be frozen or split); train the reward model with data parallelism")
            asked = [flag(name) for name in ("rm_type", "custom_rm_path", "rm_url", "rm_path", "genrm_model_path",
                                             "eval_rm_type") if getattr(self, name) is not None]
            if asked:
                raise ValueError(f"{', '.join(asked)}: {flag('loss_type')} rm generates nothing to reward; its "
                                 f"evaluation is the pair accuracy on {flag('eval_prompt_data')} (pairs). Drop them "
                                 "(a setting of a --config file is cleared with --<flag> none)")
        members = len(self.rm_path or ())
        ensemble = [flag(name) for name in ("rm_ensemble_reduce", "rm_ensemble_std_coef") if self.changed(name)]
        if ensemble and members < 2:
            raise ValueError(f"{', '.join(ensemble)}: settings of an ensemble of reward models, and "
                             f"{flag('rm_path')} names {members}")
        if self.changed("rm_ensemble_std_coef") and self.rm_ensemble_reduce != "mean_minus_std":
            raise ValueError(f"{flag('rm_ensemble_std_coef')} weighs the disagreement of {flag('rm_ensemble_reduce')} "
                             f"mean_minus_std, not {self.rm_ensemble_reduce}")
        judge = [flag(name) for name in ("genrm_prompt_template", "genrm_sampling_config", "genrm_engine_config")
                 if self.changed(name)]
        if judge and self.genrm_model_path is None:
            raise ValueError(f"{', '.join(judge)}: settings of the judge model of {flag('genrm_model_path')}, which "
                             "is not set")
        if self.changed("custom_rm_workers") and self.custom_rm_path is None:
            raise ValueError(f"{flag('custom_rm_workers')}: the processes that run {flag('custom_rm_path')}'s "
                             "function, which is not set")
        if self.eval_rm_type is not None and not self.eval_prompt_data:
            raise ValueError(f"{flag('eval_rm_type')} grades the held-out sets of {flag('eval_prompt_data')}, and "
                             "there are none")

    def _check_over_sampling(self) -> None:
        """--over-sampling-batch-size above --rollout-batch-size carries decoding groups into the next steps
        (`relax.core.streaming.carry_over`); upstream only warns that a surplus is discarded where it has no use."""
        given = self.over_sampling_batch_size
        if given is None or given == self.rollout_batch_size:
            return
        name = f"{flag('over_sampling_batch_size')} {given}"
        if given < self.rollout_batch_size:
            raise ValueError(f"{name} must be >= {flag('rollout_batch_size')} ({self.rollout_batch_size})")
        needs = [flag(missing) for missing, on in (("fully_async", self.fully_async),
                                                   ("partial_rollout", self.partial_rollout)) if not on]
        if needs:
            raise ValueError(f"{name} carries the groups still decoding into the next steps: it needs "
                             f"{' and '.join(needs)} (without them a step's rollout ends with its last group, and "
                             "a surplus would only be discarded)")
        if self.max_staleness < 2:
            raise ValueError(f"{name} needs {flag('max_staleness')} >= 2, got {self.max_staleness}: a group taken a "
                             "step after the one that launched it is one weight version older, so the producer runs "
                             "ahead by --max-staleness - 1 steps and keeps one for the groups it carries")
        refusals = {flag("placement") + " ray": self.placement == "ray",
                    flag("dynamic_sampling_filter_path"): bool(self.dynamic_sampling_filter_path),
                    flag("use_rollout_routing_replay"): self.use_rollout_routing_replay}
        refused = [what for what, on in refusals.items() if on]
        if refused:
            raise ValueError(f"{name} with {', '.join(refused)} is not built (carry-over runs in the in-process "
                             "placement, on groups kept whole as they finish, without a routing replay across "
                             "weight versions)")

    def _check_mode(self, spec) -> None:
        asynchronous = self.fully_async or self.hybrid
        if self.fully_async and self.hybrid:
            raise ValueError(f"{flag('fully_async')} and {flag('hybrid')} are exclusive (hybrid is its own mode)")
        if self.colocate and asynchronous:
            raise ValueError(f"{flag('colocate')} is the synchronous mode; drop it for "
                             f"{flag('hybrid') if self.hybrid else flag('fully_async')}")
        if self.max_staleness and not asynchronous:
            raise ValueError(f"{flag('max_staleness')} needs {flag('fully_async')} or {flag('hybrid')}")
        if self.partial_rollout and not self.fully_async:
            raise ValueError(f"{flag('partial_rollout')} needs {flag('fully_async')}")
        self._check_over_sampling()
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError(f"{flag('mask_offpolicy_in_partial_rollout')} needs {flag('partial_rollout')}")
        if asynchronous and spec.requires_on_policy_updates:
            raise ValueError(f"{flag('advantage_estimator')} {spec.name} is on-policy by construction; it cannot run "
                             f"with {flag('fully_async')} or {flag('hybrid')}")
        if asynchronous and self.trains_on_dataset:
            raise ValueError(f"{flag('loss_type')} {self.loss_type} has no rollout to run asynchronously")
        if self.use_rollout_routing_replay and self.trains_on_dataset:
            raise ValueError(f"{flag('use_rollout_routing_replay')} replays a rollout's routing; "
                             f"{flag('loss_type')} {self.loss_type} has no rollout")
        if self.use_rollout_routing_replay and self.rollout_external and self.rollout_engine_protocol in (
                "openai", "vllm"):
            raise ValueError(f"{flag('use_rollout_routing_replay')}: {self.rollout_engine_protocol} servers do not "
                             f"return routed experts; use {flag('rollout_engine_protocol')} relax or sglang")
        self._check_offload(asynchronous)
        if self.colocate_async and not self._embedded_rollout:
            raise ValueError(f"{flag('colocate_async')} overlaps the embedded engine and the trainer on one device; "
                             f"with {flag('placement')} ray, {flag('rollout_external')} or {flag('rollout_api_port')} "
                             f"rollout runs elsewhere and overlaps already: use {flag('fully_async')}")
        for name in ("agentic_admission_headroom", "agentic_admission_pressure", "agentic_admission_max_wait"):
            if self.changed(name) and not self.agentic_program_admission:
                raise ValueError(f"{flag(name)} needs {flag('agentic_program_admission')}")
        if self.changed("agentic_session_idle_timeout") and not self.agentic_session_lifecycle:
            raise ValueError(f"{flag('agentic_session_idle_timeout')} needs {flag('agentic_session_lifecycle')}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"{flag('max_total_tokens')} {self.max_total_tokens} is less than one page of "
                             f"{flag('page_size')} {self.page_size}: the engine's KV pool would hold no block")
        if self.rollout_fp8 and self.engine_core == "off":
            raise ValueError(f"{flag('rollout_fp8')} runs on the paged engine core; {flag('engine_core')} off "
                             "serves the model's own forward")
        if self.kv_cache_dtype != "auto" and (self.engine_core == "off" or not self.builds_an_engine):
            raise ValueError(f"{flag('kv_cache_dtype')} {self.kv_cache_dtype} is the paged engine core's KV pool; "
                             f"{flag('engine_core')} off, or {flag('rollout_external')} servers the run does not "
                             f"start ({flag('rollout_engine_protocol')} relax starts its own and passes it on), "
                             "roll out elsewhere (SGLang has its own --kv-cache-dtype)")
        engine_flags = [flag(name) for name in ENGINE_SETTINGS if self.changed(name)]
        if engine_flags and not self.builds_an_engine:
            raise ValueError(f"{', '.join(engine_flags)}: settings of an engine the run builds; the "
                             f"{flag('rollout_external')} servers the run does not start size their own (SGLang's "
                             f"flags of the same names; {flag('rollout_engine_protocol')} relax starts `relax serve` "
                             "processes and passes them on)")
        if self.rollout_fp8 and self.rollout_external:
            raise ValueError(f"{flag('rollout_fp8')} quantises the embedded engine; with {flag('rollout_external')} "
                             "the servers quantise their own weights (SGLang's --quantization fp8)")
        if self.colocate_async and self.rollout_serve_replicas:
            raise ValueError(f"{flag('colocate_async')} overlaps the embedded engine with the trainer; "
                             f"{flag('rollout_serve_replicas')} serves rollout from other processes: use "
                             f"{flag('fully_async')}")
