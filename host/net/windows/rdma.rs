//! The RDMA verbs transport (feature `rdma`): one reliable-connected queue pair per (origin,
//! target) pair; puts are RDMA writes, gets RDMA reads, signals an RDMA write of the new value
//! (set) or an atomic fetch-and-add (add), atomics the verbs atomics, all on the target's
//! registered window. Every work request is signalled and waited for before the next is
//! posted, so the link is ordered and `flush` has nothing left to wait for: simple and correct,
//! not yet pipelined. The origin stages bytes through a registered buffer of its own. A
//! target's window may be host memory or GPU memory (registered through a dma-buf).
//!
//! Setup: `Device::open` picks the first device with an active port; each side registers its
//! window (`Region`), creates a `Pending` queue pair, publishes its `Endpoint` through the
//! store, and `Pending::connect` brings the pair to ready-to-send with the peer's endpoint.

#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code, clippy::all)]
#[allow(clippy::pedantic, unsafe_op_in_unsafe_fn)]
mod verbs {
    include!(concat!(env!("OUT_DIR"), "/verbs.rs"));
}

use super::link::Link;
use crate::contracts::error::{Error, Result};
use crate::contracts::window::SignalOp;
use std::ffi::CStr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use verbs::*;

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: "rdma".into(),
        reason: reason.into(),
    }
}

fn os_error(call: &str) -> Error {
    Error::Backend {
        backend: "rdma".into(),
        call: call.into(),
        message: std::io::Error::last_os_error().to_string(),
    }
}

/// An opened device: its context, protection domain and the active port used.
pub(crate) struct Device {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    port: u8,
    lid: u16,
    gid: [u8; 16],
    mtu: ibv_mtu,
    pub name: String,
}

// SAFETY: verbs objects may be used from any thread; ferrocomm serialises each queue pair
// behind its link's mutex.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// The first device with an active port; `Error::Unavailable` when there is none.
    pub(crate) fn open() -> Result<Arc<Device>> {
        let mut n = 0;
        // SAFETY: ibv_get_device_list returns an array of n devices, freed below.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() || n == 0 {
            if !list.is_null() {
                // SAFETY: returned by ibv_get_device_list.
                unsafe { ibv_free_device_list(list) };
            }
            return Err(unavailable(
                "no RDMA device on this machine (ibv_get_device_list found none)",
            ));
        }
        let mut found = Err(unavailable(format!("none of the {n} RDMA devices has an active port")));
        for i in 0..n as usize {
            // SAFETY: i < n.
            let dev = unsafe { *list.add(i) };
            if let Some(d) = Self::try_open(dev) {
                found = Ok(Arc::new(d));
                break;
            }
        }
        // SAFETY: the opened context does not depend on the list.
        unsafe { ibv_free_device_list(list) };
        found
    }

    fn try_open(dev: *mut ibv_device) -> Option<Device> {
        // SAFETY: dev comes from the device list; every object made here is freed on failure.
        unsafe {
            let name = CStr::from_ptr(ibv_get_device_name(dev)).to_string_lossy().into_owned();
            let ctx = ibv_open_device(dev);
            if ctx.is_null() {
                return None;
            }
            for port in 1..=2u8 {
                let mut attr: ibv_port_attr = std::mem::zeroed();
                if ferrocomm_query_port(ctx, port, &mut attr) != 0 || attr.state != ibv_port_state_IBV_PORT_ACTIVE {
                    continue;
                }
                let mut gid: ibv_gid = std::mem::zeroed();
                // RoCE needs a GID; InfiniBand routes by LID (a zero GID is fine there).
                let _ = ibv_query_gid(ctx, port, 0, &mut gid);
                let pd = ibv_alloc_pd(ctx);
                if pd.is_null() {
                    break;
                }
                return Some(Device {
                    ctx,
                    pd,
                    port,
                    lid: attr.lid,
                    gid: gid.raw,
                    mtu: attr.active_mtu,
                    name,
                });
            }
            ibv_close_device(ctx);
            None
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: made in try_open; every region and queue pair holds an Arc<Device>.
        unsafe {
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

/// Memory registered for local and remote access.
pub(crate) struct Region {
    mr: *mut ibv_mr,
    /// The address of the region's first byte in work requests: its host address, or the
    /// I/O virtual address given to a dma-buf registration (whose `mr.addr` is the offset).
    base: u64,
    _dev: Arc<Device>,
}

// SAFETY: as for Device.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

const REMOTE_ACCESS: u32 = ibv_access_flags_IBV_ACCESS_LOCAL_WRITE
    | ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
    | ibv_access_flags_IBV_ACCESS_REMOTE_READ
    | ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC;

impl Region {
    /// Registers `bytes` at `addr`, which must stay allocated while the region lives.
    pub(crate) fn register(dev: &Arc<Device>, addr: *mut u8, bytes: usize) -> Result<Region> {
        // SAFETY: the caller keeps [addr, addr + bytes) allocated for the region's life.
        let mr = unsafe { ibv_reg_mr(dev.pd, addr.cast(), bytes.max(1), REMOTE_ACCESS as i32) };
        if mr.is_null() {
            return Err(os_error("ibv_reg_mr"));
        }
        Ok(Region {
            mr,
            base: addr as u64,
            _dev: dev.clone(),
        })
    }

    /// Registers `bytes` from `offset` of the dma-buf `fd` (GPU memory: GPUDirect RDMA), reached
    /// in work requests at `iova` onwards. The memory must stay allocated while the region
    /// lives; the descriptor may be closed once this returns.
    pub(crate) fn register_dmabuf(
        dev: &Arc<Device>,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: usize,
        bytes: usize,
        iova: u64,
    ) -> Result<Region> {
        use std::os::fd::AsRawFd;
        // SAFETY: fd is a live dma-buf; the caller keeps the memory behind it allocated.
        let mr = unsafe {
            ibv_reg_dmabuf_mr(
                dev.pd,
                offset as u64,
                bytes.max(1),
                iova,
                fd.as_raw_fd(),
                REMOTE_ACCESS as i32,
            )
        };
        if mr.is_null() {
            return Err(os_error("ibv_reg_dmabuf_mr"));
        }
        Ok(Region {
            mr,
            base: iova,
            _dev: dev.clone(),
        })
    }

    fn addr(&self) -> u64 {
        self.base
    }
    fn lkey(&self) -> u32 {
        // SAFETY: mr is valid while the region lives.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered in `register`.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// What a peer needs to reach one of our queue pairs and our window: sent through the store
/// as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub lid: u16,
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    pub data: (u64, u32),
    pub pad: (u64, u32),
}

impl Endpoint {
    pub(crate) fn encode(&self) -> String {
        let gid: String = self.gid.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "{} {} {} {gid} {} {} {} {}",
            self.lid, self.qpn, self.psn, self.data.0, self.data.1, self.pad.0, self.pad.1
        )
    }

    pub(crate) fn decode(s: &str) -> Result<Endpoint> {
        let bad = || Error::protocol("rdma setup", format!("malformed endpoint {s:?}"));
        let f: Vec<&str> = s.split_whitespace().collect();
        if f.len() != 8 || f[3].len() != 32 {
            return Err(bad());
        }
        let mut gid = [0u8; 16];
        for (i, g) in gid.iter_mut().enumerate() {
            *g = u8::from_str_radix(&f[3][2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        let n = |i: usize| f[i].parse::<u64>().map_err(|_| bad());
        Ok(Endpoint {
            lid: n(0)? as u16,
            qpn: n(1)? as u32,
            psn: n(2)? as u32,
            gid,
            data: (n(4)?, n(5)? as u32),
            pad: (n(6)?, n(7)? as u32),
        })
    }
}

/// Bytes an origin stages per work request.
const STAGING: usize = 1 << 20;

/// A queue pair created but not yet connected.
pub(crate) struct Pending {
    qp: *mut ibv_qp,
    cq: *mut ibv_cq,
    psn: u32,
    dev: Arc<Device>,
}

// SAFETY: as for Device.
unsafe impl Send for Pending {}

impl Pending {
    pub(crate) fn create(dev: &Arc<Device>) -> Result<Pending> {
        // SAFETY: objects made on an open context; freed on failure or by RdmaLink's drop.
        unsafe {
            let cq = ibv_create_cq(dev.ctx, 16, std::ptr::null_mut(), std::ptr::null_mut(), 0);
            if cq.is_null() {
                return Err(os_error("ibv_create_cq"));
            }
            let mut init: ibv_qp_init_attr = std::mem::zeroed();
            init.send_cq = cq;
            init.recv_cq = cq;
            init.qp_type = ibv_qp_type_IBV_QPT_RC;
            init.cap.max_send_wr = 16;
            init.cap.max_recv_wr = 1;
            init.cap.max_send_sge = 1;
            init.cap.max_recv_sge = 1;
            let qp = ibv_create_qp(dev.pd, &mut init);
            if qp.is_null() {
                ibv_destroy_cq(cq);
                return Err(os_error("ibv_create_qp"));
            }
            let mut psn = [0u8; 4];
            if getrandom::getrandom(&mut psn).is_err() {
                psn = (std::process::id() ^ (*qp).qp_num).to_le_bytes();
            }
            Ok(Pending {
                qp,
                cq,
                psn: u32::from_le_bytes(psn) & 0xff_ffff,
                dev: dev.clone(),
            })
        }
    }

    /// Our end of the pair, with the window regions peers may access.
    pub(crate) fn endpoint(&self, data: &Region, pad: &Region) -> Endpoint {
        Endpoint {
            lid: self.dev.lid,
            // SAFETY: qp is valid.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            gid: self.dev.gid,
            data: (data.addr(), data.rkey()),
            pad: (pad.addr(), pad.rkey()),
        }
    }

    /// Brings the pair to ready-to-send toward `remote` and returns the link to rank `peer`,
    /// whose pad slot for signal `id` is `[id][rank]` of `size` ranks.
    pub(crate) fn connect(
        self,
        remote: &Endpoint,
        peer: usize,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<RdmaLink> {
        // SAFETY: attribute structs zeroed then filled per the verbs state machine.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state_IBV_QPS_INIT;
            a.port_num = self.dev.port;
            a.qp_access_flags = ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
                | ibv_access_flags_IBV_ACCESS_REMOTE_READ
                | ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC;
            let mask = ibv_qp_attr_mask_IBV_QP_STATE
                | ibv_qp_attr_mask_IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask_IBV_QP_PORT
                | ibv_qp_attr_mask_IBV_QP_ACCESS_FLAGS;
            if ibv_modify_qp(self.qp, &mut a, mask as i32) != 0 {
                return Err(os_error("ibv_modify_qp(INIT)"));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state_IBV_QPS_RTR;
            a.path_mtu = self.dev.mtu;
            a.dest_qp_num = remote.qpn;
            a.rq_psn = remote.psn;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = remote.lid;
            a.ah_attr.port_num = self.dev.port;
            if remote.gid != [0; 16] {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = remote.gid;
                a.ah_attr.grh.hop_limit = 1;
            }
            let mask = ibv_qp_attr_mask_IBV_QP_STATE
                | ibv_qp_attr_mask_IBV_QP_AV
                | ibv_qp_attr_mask_IBV_QP_PATH_MTU
                | ibv_qp_attr_mask_IBV_QP_DEST_QPN
                | ibv_qp_attr_mask_IBV_QP_RQ_PSN
                | ibv_qp_attr_mask_IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask_IBV_QP_MIN_RNR_TIMER;
            if ibv_modify_qp(self.qp, &mut a, mask as i32) != 0 {
                return Err(os_error("ibv_modify_qp(RTR)"));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state_IBV_QPS_RTS;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.sq_psn = self.psn;
            a.max_rd_atomic = 1;
            let mask = ibv_qp_attr_mask_IBV_QP_STATE
                | ibv_qp_attr_mask_IBV_QP_TIMEOUT
                | ibv_qp_attr_mask_IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask_IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask_IBV_QP_SQ_PSN
                | ibv_qp_attr_mask_IBV_QP_MAX_QP_RD_ATOMIC;
            if ibv_modify_qp(self.qp, &mut a, mask as i32) != 0 {
                return Err(os_error("ibv_modify_qp(RTS)"));
            }
        }
        let mut staging = vec![0u64; STAGING / 8].into_boxed_slice();
        let region = Region::register(&self.dev, staging.as_mut_ptr().cast(), STAGING)?;
        Ok(RdmaLink {
            pending: self,
            staging,
            region,
            remote: remote.clone(),
            peer,
            slot_base: rank,
            size,
            timeout,
        })
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // SAFETY: made in `create`.
        unsafe {
            ibv_destroy_qp(self.qp);
            ibv_destroy_cq(self.cq);
        }
    }
}

/// A connected queue pair to one target's window.
pub(crate) struct RdmaLink {
    pending: Pending,
    // Field order: the region is deregistered before its memory is freed.
    region: Region,
    staging: Box<[u64]>,
    remote: Endpoint,
    peer: usize,
    /// Our column of the target's signal pad.
    slot_base: usize,
    size: usize,
    timeout: Duration,
}

// SAFETY: as for Device; the staging buffer is owned.
unsafe impl Send for RdmaLink {}

impl RdmaLink {
    fn staging_bytes(&mut self) -> &mut [u8] {
        // SAFETY: u64 storage viewed as bytes.
        unsafe { std::slice::from_raw_parts_mut(self.staging.as_mut_ptr().cast(), STAGING) }
    }

    /// Posts one work request on `len` staged bytes and waits for its completion.
    fn run(
        &mut self,
        op: &'static str,
        opcode: ibv_wr_opcode,
        len: usize,
        remote: u64,
        rkey: u32,
        atomic: (u64, u64),
    ) -> Result<()> {
        let mut sge = ibv_sge {
            addr: self.region.addr(),
            length: len as u32,
            lkey: self.region.lkey(),
        };
        // SAFETY: a zeroed work request filled for one opcode; sge and the staging buffer
        // outlive the wait below.
        unsafe {
            let mut wr: ibv_send_wr = std::mem::zeroed();
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = opcode;
            wr.send_flags = ibv_send_flags_IBV_SEND_SIGNALED;
            if opcode == ibv_wr_opcode_IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == ibv_wr_opcode_IBV_WR_ATOMIC_CMP_AND_SWP
            {
                // Fence: the atomic waits for earlier reads and writes of this pair.
                wr.send_flags |= ibv_send_flags_IBV_SEND_FENCE;
                wr.wr.atomic.remote_addr = remote;
                wr.wr.atomic.rkey = rkey;
                wr.wr.atomic.compare_add = atomic.0;
                wr.wr.atomic.swap = atomic.1;
            } else {
                wr.wr.rdma.remote_addr = remote;
                wr.wr.rdma.rkey = rkey;
            }
            let mut bad = std::ptr::null_mut();
            if ibv_post_send(self.pending.qp, &mut wr, &mut bad) != 0 {
                return Err(os_error("ibv_post_send"));
            }
            let deadline = Instant::now() + self.timeout;
            let mut wc: ibv_wc = std::mem::zeroed();
            loop {
                match ibv_poll_cq(self.pending.cq, 1, &mut wc) {
                    0 if Instant::now() >= deadline => {
                        return Err(Error::Timeout {
                            op,
                            peer: Some(self.peer),
                            after: self.timeout,
                        })
                    }
                    0 => std::hint::spin_loop(),
                    1 if wc.status == ibv_wc_status_IBV_WC_SUCCESS => return Ok(()),
                    1 => {
                        let why = CStr::from_ptr(ibv_wc_status_str(wc.status)).to_string_lossy();
                        return Err(Error::PeerLost {
                            op,
                            peer: self.peer,
                            reason: format!("RDMA completion: {why}"),
                        });
                    }
                    _ => return Err(os_error("ibv_poll_cq")),
                }
            }
        }
    }

    fn word(&self) -> u64 {
        self.staging[0]
    }
}

impl Link for RdmaLink {
    fn transport(&self) -> &'static str {
        "rdma"
    }

    fn put(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        for (i, chunk) in src.chunks(STAGING).enumerate() {
            self.staging_bytes()[..chunk.len()].copy_from_slice(chunk);
            let at = self.remote.data.0 + (offset + i * STAGING) as u64;
            self.run(
                "put",
                ibv_wr_opcode_IBV_WR_RDMA_WRITE,
                chunk.len(),
                at,
                self.remote.data.1,
                (0, 0),
            )?;
        }
        Ok(())
    }

    fn get(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        for (i, chunk) in dst.chunks_mut(STAGING).enumerate() {
            let at = self.remote.data.0 + (offset + i * STAGING) as u64;
            self.run(
                "get",
                ibv_wr_opcode_IBV_WR_RDMA_READ,
                chunk.len(),
                at,
                self.remote.data.1,
                (0, 0),
            )?;
            chunk.copy_from_slice(&self.staging_bytes()[..chunk.len()]);
        }
        Ok(())
    }

    fn signal(&mut self, id: usize, op: SignalOp, value: u64) -> Result<()> {
        let at = self.remote.pad.0 + ((id * self.size + self.slot_base) * 8) as u64;
        let rkey = self.remote.pad.1;
        match op {
            SignalOp::Set => {
                self.staging[0] = value;
                self.run("signal", ibv_wr_opcode_IBV_WR_RDMA_WRITE, 8, at, rkey, (0, 0))
            }
            SignalOp::Add => self.run(
                "signal",
                ibv_wr_opcode_IBV_WR_ATOMIC_FETCH_AND_ADD,
                8,
                at,
                rkey,
                (value, 0),
            ),
        }
    }

    fn fetch_add(&mut self, offset: usize, value: u64) -> Result<u64> {
        let at = self.remote.data.0 + offset as u64;
        self.run(
            "fetch_add",
            ibv_wr_opcode_IBV_WR_ATOMIC_FETCH_AND_ADD,
            8,
            at,
            self.remote.data.1,
            (value, 0),
        )?;
        Ok(self.word())
    }

    fn compare_swap(&mut self, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        let at = self.remote.data.0 + offset as u64;
        let rkey = self.remote.data.1;
        self.run(
            "compare_swap",
            ibv_wr_opcode_IBV_WR_ATOMIC_CMP_AND_SWP,
            8,
            at,
            rkey,
            (expected, desired),
        )?;
        Ok(self.word())
    }

    fn flush(&mut self) -> Result<()> {
        // Every request was waited for when it was posted.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_survive_the_store() {
        let e = Endpoint {
            lid: 7,
            qpn: 0x1234,
            psn: 0xabcdef,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            data: (0x7f00_0000_1000, 99),
            pad: (0x7f00_0000_9000, 100),
        };
        assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
        assert!(Endpoint::decode("1 2 3").is_err());
        assert!(Endpoint::decode(&e.encode().replace("fe80", "zz80")).is_err());
    }

    #[test]
    fn a_machine_without_rdma_devices_says_so() {
        match Device::open() {
            Ok(d) => println!("RDMA device {} opened: the RDMA transport can run here", d.name),
            Err(e) => {
                assert!(matches!(e, Error::Unavailable { .. }), "{e}");
                println!("SKIPPED rdma data path: {e}");
            }
        }
    }
}
