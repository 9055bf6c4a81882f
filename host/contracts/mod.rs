//! Layer 1, the contracts: plain vocabulary and the traits every other layer builds on.
//! Element types and reduce ops, operation descriptions, errors, options and the typed
//! settings read from the environment, the window vocabulary and the device handle ABI, the
//! backend, window-backend, store and fence traits.
//!
//! May import: nothing of this crate outside this folder.

pub(crate) mod backend;
pub(crate) mod bufs;
pub(crate) mod config;
pub(crate) mod dtype;
pub(crate) mod error;
pub(crate) mod fence;
pub(crate) mod fp8;
pub(crate) mod inference;
pub(crate) mod ops;
pub(crate) mod options;
pub(crate) mod placement;
pub(crate) mod record;
pub(crate) mod reduce;
pub(crate) mod store;
pub(crate) mod window;
pub(crate) mod window_handle;
