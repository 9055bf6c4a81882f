//! `FERROCOMM_LOG=<filter>` (tracing's env-filter syntax, e.g. `debug` or `ferrocomm=trace`)
//! turns on ferrocomm's logs on stderr, unless the application installed a subscriber itself.

use crate::contracts::config::Config;

/// Installs the subscriber once per process, with the filter of the first communicator's
/// settings.
pub(crate) fn init(config: &Config) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(filter) = &config.log {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}
