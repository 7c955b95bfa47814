from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JsonValue(_message.Message):
    __slots__ = ("null_value", "int_value", "double_value", "string_value", "bool_value", "list_value", "object_value")
    NULL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    LIST_VALUE_FIELD_NUMBER: _ClassVar[int]
    OBJECT_VALUE_FIELD_NUMBER: _ClassVar[int]
    null_value: _struct_pb2.NullValue
    int_value: int
    double_value: float
    string_value: str
    bool_value: bool
    list_value: JsonList
    object_value: JsonObject
    def __init__(self, null_value: _Optional[_Union[_struct_pb2.NullValue, str]] = ..., int_value: _Optional[int] = ..., double_value: _Optional[float] = ..., string_value: _Optional[str] = ..., bool_value: _Optional[bool] = ..., list_value: _Optional[_Union[JsonList, _Mapping]] = ..., object_value: _Optional[_Union[JsonObject, _Mapping]] = ...) -> None: ...

class JsonList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[JsonValue]
    def __init__(self, values: _Optional[_Iterable[_Union[JsonValue, _Mapping]]] = ...) -> None: ...

class JsonObject(_message.Message):
    __slots__ = ("fields",)
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.RepeatedCompositeFieldContainer[JsonField]
    def __init__(self, fields: _Optional[_Iterable[_Union[JsonField, _Mapping]]] = ...) -> None: ...

class JsonField(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: JsonValue
    def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[JsonValue, _Mapping]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ack(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("group", "rank", "group_size", "address", "incarnation", "exchange", "resume_step", "resume_exact")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUME_EXACT_FIELD_NUMBER: _ClassVar[int]
    group: int
    rank: int
    group_size: int
    address: str
    incarnation: str
    exchange: int
    resume_step: int
    resume_exact: bool
    def __init__(self, group: _Optional[int] = ..., rank: _Optional[int] = ..., group_size: _Optional[int] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., exchange: _Optional[int] = ..., resume_step: _Optional[int] = ..., resume_exact: _Optional[bool] = ...) -> None: ...

class RankAddresses(_message.Message):
    __slots__ = ("addresses",)
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("epoch", "members", "ring_order", "heal", "setting", "resume_step")
    class MembersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: RankAddresses
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[RankAddresses, _Mapping]] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RING_ORDER_FIELD_NUMBER: _ClassVar[int]
    HEAL_FIELD_NUMBER: _ClassVar[int]
    SETTING_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    members: _containers.MessageMap[int, RankAddresses]
    ring_order: _containers.RepeatedScalarFieldContainer[int]
    heal: bool
    setting: str
    resume_step: int
    def __init__(self, epoch: _Optional[int] = ..., members: _Optional[_Mapping[int, RankAddresses]] = ..., ring_order: _Optional[_Iterable[int]] = ..., heal: _Optional[bool] = ..., setting: _Optional[str] = ..., resume_step: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("group", "rank", "step", "incarnation", "quorum")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    group: int
    rank: int
    step: int
    incarnation: str
    quorum: str
    def __init__(self, group: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., incarnation: _Optional[str] = ..., quorum: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("epoch", "quorum_lost")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUORUM_LOST_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    quorum_lost: str
    def __init__(self, epoch: _Optional[int] = ..., quorum_lost: _Optional[str] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("group", "rank", "progress")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    group: int
    rank: int
    progress: JsonObject
    def __init__(self, group: _Optional[int] = ..., rank: _Optional[int] = ..., progress: _Optional[_Union[JsonObject, _Mapping]] = ...) -> None: ...

class RoundRequest(_message.Message):
    __slots__ = ("group", "round", "param_hash")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    group: int
    round: int
    param_hash: str
    def __init__(self, group: _Optional[int] = ..., round: _Optional[int] = ..., param_hash: _Optional[str] = ...) -> None: ...

class SummaryRequest(_message.Message):
    __slots__ = ("group", "summary")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    group: int
    summary: JsonObject
    def __init__(self, group: _Optional[int] = ..., summary: _Optional[_Union[JsonObject, _Mapping]] = ...) -> None: ...

class Rates(_message.Message):
    __slots__ = ("rates",)
    class RatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    RATES_FIELD_NUMBER: _ClassVar[int]
    rates: _containers.ScalarMap[int, float]
    def __init__(self, rates: _Optional[_Mapping[int, float]] = ...) -> None: ...

class BandwidthRequest(_message.Message):
    __slots__ = ("group", "rank", "rates")
    class RatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RATES_FIELD_NUMBER: _ClassVar[int]
    group: int
    rank: int
    rates: _containers.ScalarMap[int, float]
    def __init__(self, group: _Optional[int] = ..., rank: _Optional[int] = ..., rates: _Optional[_Mapping[int, float]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("exchange",)
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    exchange: int
    def __init__(self, exchange: _Optional[int] = ...) -> None: ...

class GroupRates(_message.Message):
    __slots__ = ("ranks",)
    class RanksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: Rates
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[Rates, _Mapping]] = ...) -> None: ...
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.MessageMap[int, Rates]
    def __init__(self, ranks: _Optional[_Mapping[int, Rates]] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("version", "table")
    class TableEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: GroupRates
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[GroupRates, _Mapping]] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    table: _containers.MessageMap[int, GroupRates]
    def __init__(self, version: _Optional[int] = ..., table: _Optional[_Mapping[int, GroupRates]] = ...) -> None: ...

class QuorumRequest(_message.Message):
    __slots__ = ("group", "rank", "incarnation", "exchange", "tag", "numel", "weight", "state_hash", "delta_norm", "retry", "healable", "setting", "weight_cap")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    DELTA_NORM_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    HEALABLE_FIELD_NUMBER: _ClassVar[int]
    SETTING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CAP_FIELD_NUMBER: _ClassVar[int]
    group: int
    rank: int
    incarnation: str
    exchange: int
    tag: str
    numel: int
    weight: float
    state_hash: str
    delta_norm: float
    retry: bool
    healable: bool
    setting: str
    weight_cap: float
    def __init__(self, group: _Optional[int] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., exchange: _Optional[int] = ..., tag: _Optional[str] = ..., numel: _Optional[int] = ..., weight: _Optional[float] = ..., state_hash: _Optional[str] = ..., delta_norm: _Optional[float] = ..., retry: _Optional[bool] = ..., healable: _Optional[bool] = ..., setting: _Optional[str] = ..., weight_cap: _Optional[float] = ...) -> None: ...

class QuorumResponse(_message.Message):
    __slots__ = ("id", "exchange", "attempt", "tag", "numel", "members", "weights", "healers", "donor", "rejected", "state_hash", "evicted", "stop", "finished", "setting", "left_out", "catch_up", "disagreement", "halted")
    class MembersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: RankAddresses
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[RankAddresses, _Mapping]] = ...) -> None: ...
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class LeftOutEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: RankAddresses
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[RankAddresses, _Mapping]] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HEALERS_FIELD_NUMBER: _ClassVar[int]
    DONOR_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SETTING_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    DISAGREEMENT_FIELD_NUMBER: _ClassVar[int]
    HALTED_FIELD_NUMBER: _ClassVar[int]
    id: str
    exchange: int
    attempt: int
    tag: str
    numel: int
    members: _containers.MessageMap[int, RankAddresses]
    weights: _containers.ScalarMap[int, float]
    healers: _containers.RepeatedScalarFieldContainer[int]
    donor: int
    rejected: _containers.ScalarMap[int, str]
    state_hash: str
    evicted: str
    stop: bool
    finished: bool
    setting: str
    left_out: _containers.MessageMap[int, RankAddresses]
    catch_up: bool
    disagreement: str
    halted: str
    def __init__(self, id: _Optional[str] = ..., exchange: _Optional[int] = ..., attempt: _Optional[int] = ..., tag: _Optional[str] = ..., numel: _Optional[int] = ..., members: _Optional[_Mapping[int, RankAddresses]] = ..., weights: _Optional[_Mapping[int, float]] = ..., healers: _Optional[_Iterable[int]] = ..., donor: _Optional[int] = ..., rejected: _Optional[_Mapping[int, str]] = ..., state_hash: _Optional[str] = ..., evicted: _Optional[str] = ..., stop: _Optional[bool] = ..., finished: _Optional[bool] = ..., setting: _Optional[str] = ..., left_out: _Optional[_Mapping[int, RankAddresses]] = ..., catch_up: _Optional[bool] = ..., disagreement: _Optional[str] = ..., halted: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("group", "rank", "incarnation", "quorum_id", "exchange", "groups", "ok", "reason")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    group: int
    rank: int
    incarnation: str
    quorum_id: str
    exchange: int
    groups: _containers.RepeatedScalarFieldContainer[int]
    ok: bool
    reason: str
    def __init__(self, group: _Optional[int] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., quorum_id: _Optional[str] = ..., exchange: _Optional[int] = ..., groups: _Optional[_Iterable[int]] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed", "reason")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    reason: str
    def __init__(self, committed: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class StateOffer(_message.Message):
    __slots__ = ("quorum_id", "donor_group", "donor_rank", "healer_group", "healer_rank", "nbytes", "digest")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    DONOR_GROUP_FIELD_NUMBER: _ClassVar[int]
    DONOR_RANK_FIELD_NUMBER: _ClassVar[int]
    HEALER_GROUP_FIELD_NUMBER: _ClassVar[int]
    HEALER_RANK_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    quorum_id: str
    donor_group: int
    donor_rank: int
    healer_group: int
    healer_rank: int
    nbytes: int
    digest: str
    def __init__(self, quorum_id: _Optional[str] = ..., donor_group: _Optional[int] = ..., donor_rank: _Optional[int] = ..., healer_group: _Optional[int] = ..., healer_rank: _Optional[int] = ..., nbytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class OfferQuery(_message.Message):
    __slots__ = ("quorum_id", "healer_group", "healer_rank")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    HEALER_GROUP_FIELD_NUMBER: _ClassVar[int]
    HEALER_RANK_FIELD_NUMBER: _ClassVar[int]
    quorum_id: str
    healer_group: int
    healer_rank: int
    def __init__(self, quorum_id: _Optional[str] = ..., healer_group: _Optional[int] = ..., healer_rank: _Optional[int] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...
