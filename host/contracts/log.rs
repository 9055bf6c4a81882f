//! `FERROCOMM_LOG=<filter>` (tracing's env-filter syntax, e.g. `debug` or `ferrocomm=trace`)
//! turns on ferrocomm's logs on stderr, unless the application installed a subscriber itself.

pub(crate) fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("FERROCOMM_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}
