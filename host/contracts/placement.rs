//! Where a communicator's buffers live and its kernels run: the `Device` a rank is made on.

/// Where a communicator's buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory.
    Cpu,
    /// CUDA device `ordinal`.
    Cuda(usize),
    /// The host device `index`: the `device` backend with its kernels on CPU threads (one OS
    /// thread per CUDA thread, every block of a launch at once) and its windows in shared host
    /// memory, for machines without a GPU (a build with the `host-kernels` feature). Buffers
    /// are host memory: collectives on them run the device backend's own kernels.
    Host(usize),
}
