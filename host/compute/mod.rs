//! Host arithmetic of the inference collectives, shared by the CPU backend (the oracle) and
//! the device backend's host paths: element rows to and from f32, the residual add and
//! RMSNorm of one token row, and fp8 quantisation. The device kernels implement the same
//! definitions in device-api/include/ferrocomm/norm.cuh.
//!
//! May import: the contracts.

pub(crate) mod rmsnorm;
pub(crate) mod rows;
