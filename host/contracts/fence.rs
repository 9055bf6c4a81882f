//! The contract between an asynchronous operation's waiter and a GPU backend that left device
//! work running after the operation's host part returned.

use crate::contracts::error::Result;
use std::sync::Mutex;

/// Device-side completion of an asynchronous operation that a backend left running on a GPU
/// stream after its host part returned.
pub trait Fence: Send + Sync {
    /// Whether the device work has finished.
    fn is_complete(&self) -> Result<bool>;
    /// Makes `stream` (raw `CUstream`, 0 = legacy default) wait for the work; the host does not
    /// block.
    fn stream_wait(&self, stream: u64) -> Result<()>;
}

/// Where a backend leaves the [`Fence`] of an asynchronous operation.
#[derive(Default)]
pub struct FenceSlot(Mutex<Option<Box<dyn Fence>>>);

impl FenceSlot {
    /// Leaves `fence` for the operation's waiter (replacing any earlier one): `Work::wait`
    /// then orders the waiter's stream after it, and `Work::is_completed` asks it.
    pub fn set(&self, fence: Box<dyn Fence>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(fence);
    }

    pub(crate) fn is_complete(&self) -> Result<bool> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(Ok(true), |f| f.is_complete())
    }

    /// Makes `stream` (raw `CUstream`) wait for the fence, if there is one.
    pub(crate) fn stream_wait(&self, stream: u64) -> Result<()> {
        match self.0.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(f) => f.stream_wait(stream),
            None => Ok(()),
        }
    }
}
