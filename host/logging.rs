//! An opt-in log subscriber for applications that have none (feature `log-subscriber`).
//!
//! ferrocomm only emits `tracing` events; which subscriber shows them is the application's
//! choice, so the library never installs one by itself. An application that has no logging
//! of its own calls [`init_logging`] once at start, and `FERROCOMM_LOG` then works as in
//! ferrocomm's own programs.

use crate::contracts::config;
use crate::contracts::error::Result;

/// Installs a subscriber that prints events on stderr, filtered by `FERROCOMM_LOG` (tracing's
/// env-filter syntax: `debug`, `ferrocomm=trace`, ...). Returns `Ok(true)` when it installed
/// one; `Ok(false)` when `FERROCOMM_LOG` is unset or the process already has a global
/// subscriber (which then stays). A malformed `FERROCOMM_*` setting is an `Error::Config`.
///
/// ```
/// // FERROCOMM_LOG=debug ./my-app
/// let installed = ferrocomm::init_logging()?;
/// # let _ = installed;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub fn init_logging() -> Result<bool> {
    let Some(filter) = &config::current()?.log else {
        return Ok(false);
    };
    Ok(tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init()
        .is_ok())
}
