/* The ABI shared by Rust and device code: plain C structs passed by value to kernels or written
 * by kernels into host-pinned memory. host/contracts/window_handle.rs mirrors them with #[repr(C)], and the
 * test `abi_layout` compares every size and field offset with this header compiled by a C
 * compiler. Fixed-width types are spelled out so that NVRTC (no libc headers) reads it too. */
#ifndef FERROCOMM_ABI_H
#define FERROCOMM_ABI_H

typedef unsigned long long ferrocomm_u64;
typedef unsigned int ferrocomm_u32;
typedef int ferrocomm_i32;

/* The version of the structs below. Every ferrocomm_window_handle carries the version of the
 * host that made it (abi_version), and device code compares it with the one it was compiled
 * with before it touches anything else (Window::abi_ok): a kernel built against other headers
 * records FERROCOMM_STATUS_ABI_MISMATCH instead of reading fields that moved. Bump it with
 * every change of these structs; `status` and `abi_version` keep their offsets in every
 * version, so the mismatch can always be recorded. Version 1 had a reserved 0 where
 * abi_version is. */
#define FERROCOMM_ABI_VERSION 2

/* What a device wait records when it gives up (ferrocomm_status.code). The first error a
 * window records stays; later ones are dropped, so the host reports the root cause. */
#define FERROCOMM_STATUS_OK 0u
#define FERROCOMM_STATUS_TIMEOUT 1u
#define FERROCOMM_STATUS_ABORTED 2u
/* A peer's part of a collective disagreed with ours (expected: our bytes, observed: its). */
#define FERROCOMM_STATUS_MISMATCH 3u
/* A verb's argument the device cannot carry out (ferrocomm_status.op says which). */
#define FERROCOMM_STATUS_INVALID 4u
/* The window handle was made for another ABI than the kernel was compiled for
 * (expected: the kernel's FERROCOMM_ABI_VERSION, observed: the handle's abi_version; op 0). */
#define FERROCOMM_STATUS_ABI_MISMATCH 5u
/* A peer refused its call of a collective (an argument error found on its host; peer: that
 * rank): nothing moved. */
#define FERROCOMM_STATUS_REFUSED 6u

/* The device verb that recorded a status (ferrocomm_status.op). */
#define FERROCOMM_OP_WAIT_SIGNAL 1u
#define FERROCOMM_OP_BARRIER 2u
#define FERROCOMM_OP_FLUSH 3u
#define FERROCOMM_OP_COLLECTIVE 4u
/* 5: a proxy queue push (full past the deadline), or a proxy put whose source is not window
 * data (observed: the source's address). */
#define FERROCOMM_OP_PROXY 5u
/* 6, 8, 9, 10: a verb's argument outside the window, found before it touched memory (it did
 * nothing): bytes past a segment's data (expected: bytes, observed: offset), a rank that is
 * not one of the window's (peer; expected: size), a signal id past the pad (signal_id;
 * expected: signal ids per source), an atomic's offset that is not 8-byte aligned (observed). */
#define FERROCOMM_OP_OUT_OF_WINDOW 6u
#define FERROCOMM_OP_NOT_VIA_PROXY 7u /* a get, atomic or barrier toward a rank behind the queue */
#define FERROCOMM_OP_BAD_RANK 8u
#define FERROCOMM_OP_BAD_SIGNAL 9u
#define FERROCOMM_OP_MISALIGNED 10u

/* Signal operations and comparisons, numbered as host/window's SignalOp and Cmp. */
#define FERROCOMM_SIGNAL_SET 0u
#define FERROCOMM_SIGNAL_ADD 1u
#define FERROCOMM_CMP_EQ 0u
#define FERROCOMM_CMP_NE 1u
#define FERROCOMM_CMP_GE 2u
#define FERROCOMM_CMP_GT 3u
#define FERROCOMM_CMP_LE 4u
#define FERROCOMM_CMP_LT 5u

/* `wait_signal` source: a rank >= 0, or one of these. */
#define FERROCOMM_SOURCE_ANY (-1)
#define FERROCOMM_SOURCE_SUM (-2)

/* A device wait's error record, in host-pinned memory mapped into the device. */
typedef struct ferrocomm_status {
  ferrocomm_u32 code;      /* FERROCOMM_STATUS_* */
  ferrocomm_u32 op;        /* FERROCOMM_OP_* */
  ferrocomm_i32 peer;      /* the awaited rank, or a FERROCOMM_SOURCE_* value */
  ferrocomm_u32 signal_id; /* for FERROCOMM_OP_WAIT_SIGNAL */
  ferrocomm_u64 expected;  /* the value waited for */
  ferrocomm_u64 observed;  /* the last value seen */
} ferrocomm_status;

/* One rank's view of a window, passed by value to kernels.
 *
 * Every rank's segment is mapped into this process at `base + rank * stride` (symmetric
 * layout: one multiply-add finds any peer, no table to load). A segment holds, in order:
 * `data_bytes` of user data at offset 0; the signal pad at `signal_offset`, u64 slots
 * [signal_id][source_rank]; the barrier slots at `barrier_offset`, u64 [source_rank]; and at
 * `barrier_offset + size * 8` this rank's barrier epoch, a u64 only its own kernels write. */
typedef struct ferrocomm_window_handle {
  ferrocomm_u64 base;           /* device address of rank 0's segment */
  ferrocomm_u64 stride;         /* bytes between consecutive ranks' segments */
  ferrocomm_u64 data_bytes;     /* user bytes per rank */
  ferrocomm_u64 signal_offset;  /* byte offset of the signal pad in every segment */
  ferrocomm_u64 barrier_offset; /* byte offset of the barrier slots in every segment */
  ferrocomm_u64 multicast;      /* multicast address of the data, 0 without multicast */
  ferrocomm_u64 status;         /* ferrocomm_status*: this rank's error record */
  ferrocomm_u64 abort_flag;     /* const ferrocomm_u32*: nonzero once the comm is aborted */
  ferrocomm_u64 fifo;           /* ferrocomm_proxy_queue*: toward ranks not load/store reachable; 0: none */
  ferrocomm_u64 timeout_ns;     /* deadline of every device wait */
  ferrocomm_i32 rank;
  ferrocomm_i32 size;
  ferrocomm_u32 signals;     /* signal ids per source */
  ferrocomm_u32 abi_version; /* FERROCOMM_ABI_VERSION of the host that made the handle */
} ferrocomm_window_handle;

/* The proxy queue: how kernels hand puts and signals toward ranks that are not load/store
 * reachable (other hosts) to a host thread, the proxy, which runs them on the network.
 *
 * A descriptor is two u64 words in `slots[2 * (ticket % capacity)]`. A producer takes a ticket
 * with an atomic add on `head`, waits while `ticket - *tail >= capacity` (back-pressure),
 * writes word 1, then release-stores word 0: that one store publishes the slot. Bit 63 of word 0
 * is the lap parity, 1 on even laps of the ring (ticket / capacity even) and 0 on odd ones, so
 * the proxy tells a fresh descriptor from last lap's without anyone clearing slots.
 *
 *   word 0: parity (bit 63) | op (bits 56..62) | peer (bits 40..55) | low 40 bits:
 *           PUT: destination offset in the peer's window data;
 *           SIGNAL: signal id (bits 0..31), FERROCOMM_SIGNAL_* (bit 32)
 *   word 1: PUT: source offset in this rank's window data (bits 0..39) | bytes (bits 40..63);
 *           SIGNAL: the value
 *
 * The proxy advances `tail` once it has consumed a descriptor (copied it out and, for a put,
 * copied the source bytes: a put waits for that before it returns, so its source may then
 * change), and `done` (a count of descriptors) once their effects are visible at their
 * targets; `flush` waits for `done` to reach the `head` it saw. A put larger than
 * FERROCOMM_PROXY_MAX_PUT takes several slots. */
#define FERROCOMM_PROXY_PUT 1u
#define FERROCOMM_PROXY_SIGNAL 2u
#define FERROCOMM_PROXY_PARITY_BIT 63
#define FERROCOMM_PROXY_OP_SHIFT 56
#define FERROCOMM_PROXY_PEER_SHIFT 40
#define FERROCOMM_PROXY_BYTES_SHIFT 40
#define FERROCOMM_PROXY_OFFSET_MASK 0xffffffffffull /* 40 bits: windows up to 1 TiB */
#define FERROCOMM_PROXY_MAX_PUT (1ull << 23)         /* bytes per PUT descriptor */
#define FERROCOMM_PROXY_MAX_PEER 0xffff

/* What a kernel finds behind ferrocomm_window_handle.fifo (device-readable memory). */
typedef struct ferrocomm_proxy_queue {
  ferrocomm_u64 slots;    /* u64[2 * capacity]: host-pinned, mapped into the device */
  ferrocomm_u64 head;     /* u64*: tickets taken by producers (device memory) */
  ferrocomm_u64 tail;     /* const u64*: descriptors the proxy has consumed (host-pinned) */
  ferrocomm_u64 done;     /* const u64*: descriptors complete at their targets (host-pinned) */
  ferrocomm_u64 remote;   /* const unsigned char[size]: nonzero where a rank goes through this queue */
  ferrocomm_u32 capacity; /* slots, a power of two */
  ferrocomm_u32 flags;    /* reserved, 0 */
} ferrocomm_proxy_queue;

#if defined(__cplusplus) && __cplusplus >= 201103L
static_assert(sizeof(ferrocomm_status) == 32, "ferrocomm_status is 32 bytes");
static_assert(sizeof(ferrocomm_window_handle) == 96, "ferrocomm_window_handle is 96 bytes");
static_assert(sizeof(ferrocomm_proxy_queue) == 48, "ferrocomm_proxy_queue is 48 bytes");
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(ferrocomm_status) == 32, "ferrocomm_status is 32 bytes");
_Static_assert(sizeof(ferrocomm_window_handle) == 96, "ferrocomm_window_handle is 96 bytes");
_Static_assert(sizeof(ferrocomm_proxy_queue) == 48, "ferrocomm_proxy_queue is 48 bytes");
#endif

#endif /* FERROCOMM_ABI_H */
