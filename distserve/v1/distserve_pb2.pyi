from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EarlyStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOPPING_FALSE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_TRUE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_NEVER: _ClassVar[EarlyStopping]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_COLOCATED: _ClassVar[Role]
EARLY_STOPPING_FALSE: EarlyStopping
EARLY_STOPPING_TRUE: EarlyStopping
EARLY_STOPPING_NEVER: EarlyStopping
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_COLOCATED: Role

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "logprobs", "prompt_logprobs", "truncate_prompt_tokens", "structured_outputs", "n", "cache_salt", "beam_width", "length_penalty", "early_stopping")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    min_p: float
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    prompt_logprobs: int
    truncate_prompt_tokens: int
    structured_outputs: StructuredOutputs
    n: int
    cache_salt: str
    beam_width: int
    length_penalty: float
    early_stopping: EarlyStopping
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[EarlyStopping, str]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: ChoiceList
    grammar: str
    json_object: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling_params", "priority", "slo_ttft", "slo_tpot", "timeline")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling_params: SamplingParams
    priority: int
    slo_ttft: float
    slo_tpot: float
    timeline: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., slo_ttft: _Optional[float] = ..., slo_tpot: _Optional[float] = ..., timeline: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft", "tpot", "e2e", "queue", "prefill", "migration")
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TPOT_FIELD_NUMBER: _ClassVar[int]
    E2E_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    ttft: float
    tpot: float
    e2e: float
    queue: float
    prefill: float
    migration: float
    def __init__(self, ttft: _Optional[float] = ..., tpot: _Optional[float] = ..., e2e: _Optional[float] = ..., queue: _Optional[float] = ..., prefill: _Optional[float] = ..., migration: _Optional[float] = ...) -> None: ...

class Timeline(_message.Message):
    __slots__ = ("arrival", "prefill_queued", "prefill_start", "prefill_end", "prefill_batch_size", "prefill_batch_tokens", "handover", "decode_admitted", "migration_start", "migration_end", "step_starts", "step_ends", "step_batch_sizes", "token_times", "finished", "num_preemptions", "prefill_instance", "decode_instance", "local_prefill")
    ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_START_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_START_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_END_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTS_FIELD_NUMBER: _ClassVar[int]
    STEP_ENDS_FIELD_NUMBER: _ClassVar[int]
    STEP_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TIMES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    arrival: float
    prefill_queued: float
    prefill_start: float
    prefill_end: float
    prefill_batch_size: int
    prefill_batch_tokens: int
    handover: float
    decode_admitted: float
    migration_start: float
    migration_end: float
    step_starts: _containers.RepeatedScalarFieldContainer[float]
    step_ends: _containers.RepeatedScalarFieldContainer[float]
    step_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    token_times: _containers.RepeatedScalarFieldContainer[float]
    finished: float
    num_preemptions: int
    prefill_instance: str
    decode_instance: str
    local_prefill: bool
    def __init__(self, arrival: _Optional[float] = ..., prefill_queued: _Optional[float] = ..., prefill_start: _Optional[float] = ..., prefill_end: _Optional[float] = ..., prefill_batch_size: _Optional[int] = ..., prefill_batch_tokens: _Optional[int] = ..., handover: _Optional[float] = ..., decode_admitted: _Optional[float] = ..., migration_start: _Optional[float] = ..., migration_end: _Optional[float] = ..., step_starts: _Optional[_Iterable[float]] = ..., step_ends: _Optional[_Iterable[float]] = ..., step_batch_sizes: _Optional[_Iterable[int]] = ..., token_times: _Optional[_Iterable[float]] = ..., finished: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "timeline", "logprobs", "prompt_logprobs", "index", "cumulative_logprob", "beam_score")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BEAM_SCORE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    timeline: Timeline
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    cumulative_logprob: float
    beam_score: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., timeline: _Optional[_Union[Timeline, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., cumulative_logprob: _Optional[float] = ..., beam_score: _Optional[float] = ...) -> None: ...

class GetClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("name", "role", "tensor_parallel_size", "pipeline_parallel_size", "num_blocks", "block_size", "num_free_blocks", "num_waiting", "num_running", "num_held", "num_pending", "num_preemptions", "failure", "node_id", "kv_pulls", "num_swapped", "num_swap_outs", "num_swap_ins", "swap_seconds", "prompt_tokens", "cached_prompt_tokens", "tier_hit_tokens", "num_kv_checksum_mismatches", "kv_cache_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_PULLS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_INS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_CHECKSUM_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: Role
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_waiting: int
    num_running: int
    num_held: int
    num_pending: int
    num_preemptions: int
    failure: str
    node_id: str
    kv_pulls: _containers.RepeatedCompositeFieldContainer[KVPulls]
    num_swapped: int
    num_swap_outs: int
    num_swap_ins: int
    swap_seconds: float
    prompt_tokens: int
    cached_prompt_tokens: int
    tier_hit_tokens: int
    num_kv_checksum_mismatches: int
    kv_cache_dtype: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_held: _Optional[int] = ..., num_pending: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., failure: _Optional[str] = ..., node_id: _Optional[str] = ..., kv_pulls: _Optional[_Iterable[_Union[KVPulls, _Mapping]]] = ..., num_swapped: _Optional[int] = ..., num_swap_outs: _Optional[int] = ..., num_swap_ins: _Optional[int] = ..., swap_seconds: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., tier_hit_tokens: _Optional[int] = ..., num_kv_checksum_mismatches: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class KVTier(_message.Message):
    __slots__ = ("node_id", "capacity_blocks", "entries", "bytes_per_block", "queried_blocks", "hit_blocks", "remote_hit_blocks", "written_blocks", "evicted_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    QUERIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    capacity_blocks: int
    entries: int
    bytes_per_block: int
    queried_blocks: int
    hit_blocks: int
    remote_hit_blocks: int
    written_blocks: int
    evicted_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., entries: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., queried_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., remote_hit_blocks: _Optional[int] = ..., written_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ...) -> None: ...

class KVPulls(_message.Message):
    __slots__ = ("source", "transport", "pulls", "bytes", "seconds")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    source: str
    transport: str
    pulls: int
    bytes: int
    seconds: float
    def __init__(self, source: _Optional[str] = ..., transport: _Optional[str] = ..., pulls: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("model", "instances", "num_pending_requests", "max_pending_requests", "max_model_len", "draining", "vocab_size", "role_changes", "role_control", "kv_tiers", "default_sampling_params", "api_servers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    ROLE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    API_SERVERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    num_pending_requests: int
    max_pending_requests: int
    max_model_len: int
    draining: bool
    vocab_size: int
    role_changes: _containers.RepeatedCompositeFieldContainer[RoleChange]
    role_control: str
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KVTier]
    default_sampling_params: SamplingParams
    api_servers: _containers.RepeatedCompositeFieldContainer[ApiServer]
    def __init__(self, model: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., num_pending_requests: _Optional[int] = ..., max_pending_requests: _Optional[int] = ..., max_model_len: _Optional[int] = ..., draining: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., role_changes: _Optional[_Iterable[_Union[RoleChange, _Mapping]]] = ..., role_control: _Optional[str] = ..., kv_tiers: _Optional[_Iterable[_Union[KVTier, _Mapping]]] = ..., default_sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., api_servers: _Optional[_Iterable[_Union[ApiServer, _Mapping]]] = ...) -> None: ...

class ApiServer(_message.Message):
    __slots__ = ("index", "server_id", "pid", "num_pending_requests", "cpu_seconds", "restarts")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    server_id: str
    pid: int
    num_pending_requests: int
    cpu_seconds: float
    restarts: int
    def __init__(self, index: _Optional[int] = ..., server_id: _Optional[str] = ..., pid: _Optional[int] = ..., num_pending_requests: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., restarts: _Optional[int] = ...) -> None: ...

class RoleChange(_message.Message):
    __slots__ = ("instance", "old_role", "new_role", "started", "seconds", "reason", "error")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    OLD_ROLE_FIELD_NUMBER: _ClassVar[int]
    NEW_ROLE_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    instance: str
    old_role: Role
    new_role: Role
    started: float
    seconds: float
    reason: str
    error: str
    def __init__(self, instance: _Optional[str] = ..., old_role: _Optional[_Union[Role, str]] = ..., new_role: _Optional[_Union[Role, str]] = ..., started: _Optional[float] = ..., seconds: _Optional[float] = ..., reason: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class SetRolesRequest(_message.Message):
    __slots__ = ("roles", "role_control")
    class RolesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Role
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Role, str]] = ...) -> None: ...
    ROLES_FIELD_NUMBER: _ClassVar[int]
    ROLE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    roles: _containers.ScalarMap[str, Role]
    role_control: str
    def __init__(self, roles: _Optional[_Mapping[str, Role]] = ..., role_control: _Optional[str] = ...) -> None: ...

class SetRolesResponse(_message.Message):
    __slots__ = ("changes",)
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[RoleChange]
    def __init__(self, changes: _Optional[_Iterable[_Union[RoleChange, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
