"""The packed varlen batch of ARCHITECTURE.md section 2, built on the host."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .config import SpecialTokens


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated into one stream, never padded.

    Device tensors (moved by `.to`): `tokens` [T] int32, `cu_seqlens` [B+1] int32 (leading 0), `positions` [T] int32
    (index of each token within its sequence), `seq_ids` [T] int32 (sequence of each token).
    Host values (stay on the CPU, so no step reads device memory back): `max_seqlen`, `seqlens` [B] int64,
    `num_maskable` [B] int64 (tokens that may be predicted: everything but the tokenizer's pad, bos, eos and mask;
    `SpecialTokens.unmaskable`), and for a batch
    from the data loader `dataset_ids` [B] int64 (which sequences of the split these are) and `index`, the
    micro-batch's place in the run (step x micro-batches per step + its place in the step, whatever the rank
    count), which keys its masks.
    """

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor
    max_seqlen: int
    seqlens: torch.Tensor
    num_maskable: torch.Tensor
    dataset_ids: np.ndarray | None = None
    index: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.seqlens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    DEVICE_FIELDS = ("tokens", "cu_seqlens", "positions", "seq_ids")

    def device_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.DEVICE_FIELDS]

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every device tensor the batch holds (as MaskedBatch.resident_tensors)."""
        return self.device_tensors()

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        """The same batch with its device tensors on `device` in one copy (`to_device_in_one_copy`); host counts stay
        on the CPU."""
        moved = to_device_in_one_copy(self.device_tensors(), device, non_blocking)
        return replace(self, **dict(zip(self.DEVICE_FIELDS, moved)))

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], vocab_size: int | None = None,
                       device: torch.device | str | None = None,
                       special: SpecialTokens = SpecialTokens()) -> PackedBatch:
        """Pack token-id lists (each a non-empty sequence, specials included) into one varlen batch; `special`: the
        ids' special tokens (a fastmae-trained tokenizer's by default).

        Raises ValueError naming the sequence when it is empty or holds an id outside [0, vocab_size).
        """
        if len(sequences) == 0:
            raise ValueError("PackedBatch.from_sequences: no sequences given")
        arrays = [np.asarray(seq, dtype=np.int64).reshape(-1) for seq in sequences]
        for i, arr in enumerate(arrays):
            if arr.size == 0:
                raise ValueError(f"PackedBatch.from_sequences: sequence {i} is empty")
            low, high = int(arr.min()), int(arr.max())
            if low < 0 or (vocab_size is not None and high >= vocab_size):
                raise ValueError(f"PackedBatch.from_sequences: sequence {i} holds token id "
                                 f"{low if low < 0 else high} outside [0, {vocab_size})")
        return cls.from_packed(np.concatenate(arrays), np.array([a.size for a in arrays]), device=device,
                               special=special)

    @classmethod
    def from_packed(cls, tokens: np.ndarray, seqlens: np.ndarray, device=None,
                    dataset_ids: np.ndarray | None = None, index: int | None = None,
                    special: SpecialTokens = SpecialTokens()) -> PackedBatch:
        """Build from an already concatenated id array and its per-sequence lengths (the data loader's path);
        `special` as in `from_sequences`."""
        seqlens = np.asarray(seqlens, dtype=np.int64)
        tokens = np.asarray(tokens)
        if seqlens.ndim != 1 or seqlens.size == 0 or (seqlens <= 0).any() or seqlens.sum() != tokens.size:
            raise ValueError(f"PackedBatch.from_packed: lengths {seqlens.tolist()[:8]}... do not partition "
                             f"{tokens.size} tokens into non-empty sequences")
        cu = np.zeros(seqlens.size + 1, dtype=np.int64)
        np.cumsum(seqlens, out=cu[1:])
        seq_ids = np.repeat(np.arange(seqlens.size), seqlens)
        positions = np.arange(tokens.size) - cu[seq_ids]
        maskable = ~np.isin(tokens, special.unmaskable)
        num_maskable = np.bincount(seq_ids, weights=maskable, minlength=seqlens.size).astype(np.int64)
        as32 = lambda a: torch.from_numpy(a.astype(np.int32)).to(device)  # noqa: E731
        return cls(tokens=as32(tokens), cu_seqlens=as32(cu), positions=as32(positions), seq_ids=as32(seq_ids),
                   max_seqlen=int(seqlens.max()), seqlens=torch.from_numpy(seqlens),
                   num_maskable=torch.from_numpy(num_maskable), dataset_ids=dataset_ids, index=index)


COPY_ALIGNMENT = 16  # bytes: every tensor packed into a copy starts at a multiple, so its dtype view is aligned


def to_device_in_one_copy(tensors: Sequence[torch.Tensor], device, non_blocking: bool = False) -> list[torch.Tensor]:
    """Host `tensors` on `device` through one host-to-device copy: packed byte by byte into one host buffer
    (page-locked for CUDA, so that a non_blocking copy is asynchronous), copied once, and viewed back in their dtypes
    and shapes (views: the device computes nothing). Tensors already on `device` come back as they are."""
    device = torch.device(device)
    if all(t.device == device for t in tensors):
        return list(tensors)
    staging, starts = pack_bytes(tensors, pin_memory=device.type == "cuda")
    return unpack_bytes(staging.to(device, non_blocking=non_blocking), tensors, starts)


def byte_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """(the byte offset of each tensor in a buffer holding them all, the buffer's size): offsets aligned to
    COPY_ALIGNMENT, so each tensor's dtype view of the buffer is aligned."""
    starts, end = [], 0
    for tensor in tensors:
        starts.append(end)
        end += -(-tensor.numel() * tensor.element_size() // COPY_ALIGNMENT) * COPY_ALIGNMENT
    return starts, end


def pack_bytes(tensors: Sequence[torch.Tensor], pin_memory: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(one uint8 host buffer holding every tensor's bytes, the byte offset of each; see `byte_offsets`)."""
    starts, end = byte_offsets(tensors)
    buffer = torch.empty(end, dtype=torch.uint8, pin_memory=pin_memory)
    for tensor, start in zip(tensors, starts):
        buffer[start:start + tensor.numel() * tensor.element_size()].copy_(
            tensor.detach().contiguous().view(-1).view(torch.uint8))
    return buffer, starts


def unpack_bytes(buffer: torch.Tensor, like: Sequence[torch.Tensor], starts: Sequence[int]) -> list[torch.Tensor]:
    """Views of `buffer` (from `pack_bytes`, wherever it now is) with the dtypes and shapes of `like`."""
    return [buffer[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, start in zip(like, starts)]


def ahead_in_thread(items: Iterator, depth: int = 2) -> Iterator:
    """`items`, produced up to `depth` ahead by a background thread (host work that then overlaps the device's: the
    data loader, masking, layouts). An exception raised while producing is raised here, at the item it replaced."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(entry: tuple) -> bool:
        """Put `entry` for the consumer unless it has gone (False then)."""
        while not stop.is_set():
            try:
                slots.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not offer(("item", item)):
                    return
            offer(("end", None))
        except BaseException as err:  # handed to the consumer, which raises it
            offer(("error", err))

    thread = threading.Thread(target=produce, name="fastmae-batches", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = slots.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:  # the consumer is done: the producer stops after its current item, before the interpreter exits
        stop.set()
        thread.join()


def to_device_ahead(batches: Iterator, device: torch.device) -> Iterator:
    """`batches` (PackedBatch or masking.MaskedBatch) moved to `device`, one batch ahead: on CUDA each is copied in
    one asynchronous copy on a side stream while the batch before it computes, and the compute stream waits for that
    copy on the device (the host never does). Elsewhere a plain `.to(device)`."""
    if device.type != "cuda":
        for batch in batches:
            yield batch.to(device)
        return
    copy_stream = torch.cuda.Stream(device)

    def launch(batch):
        with torch.cuda.stream(copy_stream):
            moved = batch.to(device, non_blocking=True)
            return moved, copy_stream.record_event()

    ahead = None
    for batch in batches:
        current, ahead = ahead, launch(batch)
        if current is not None:
            yield _handed_over(*current)
    if ahead is not None:
        yield _handed_over(*ahead)


def _handed_over(batch, copied: torch.cuda.Event):
    """`batch`, copied on a side stream, made safe to use on the current stream: the current stream waits for the
    copy's event, and the caching allocator keeps the memory until the current stream is done with it."""
    compute = torch.cuda.current_stream(batch.device)
    compute.wait_event(copied)
    for tensor in batch.resident_tensors():  # rotary tables too: made on the side stream from the copied positions
        tensor.record_stream(compute)
    return batch
