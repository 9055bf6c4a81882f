//! Bootstrap: the rendezvous store, discovery of this process's place in the job, and the
//! core binding launchers may give ranks.
//!
//! May import: the contracts.

pub(crate) mod accept;
mod auth;
mod binding;
mod env;
mod file_store;
pub(crate) mod gate;
pub(crate) mod seal;
mod store;
mod tcp_store;
mod wire;

pub use auth::random_token;
pub use binding::{bind_to_core, cores_for_ranks};
pub use env::{discover, store_addr, RankInfo, StoreAddr};
pub use file_store::FileStore;
pub(crate) use store::{all_gather, all_gather_records};
pub use store::{MemoryStore, PrefixStore};
#[cfg(feature = "fuzzing")]
pub use tcp_store::fuzz_one_request;
pub use tcp_store::{TcpStore, TcpStoreServer};
pub use wire::DEFAULT_MAX_FRAME;

pub(crate) use auth::{nonce, proof, verify, NONCE_BYTES, PROOF_BYTES};

use crate::contracts::config::Config;
use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
use std::sync::Arc;
use std::time::Duration;

/// The job store as the environment describes it. Rank 0 hosts the TCP store server unless
/// `FERROCOMM_STORE_EXTERNAL=1` says a launcher already does (ferrocomm-run sets it).
///
/// Returns the store and, on the rank that hosts it, the server (keep it alive as long as any
/// rank uses the store). The address is [`store_addr`]'s; a TCP store needs
/// `FERROCOMM_TOKEN` (`Error::Config` without it). Clients wait up to `timeout` for the
/// server to listen.
///
/// ```
/// use ferrocomm::{store_from_env, Store};
/// use std::time::Duration;
///
/// // A store in a directory: no server, no token.
/// let dir = std::env::temp_dir().join(format!("ferrocomm-doc-store-{}", std::process::id()));
/// std::env::set_var("FERROCOMM_STORE", format!("file://{}", dir.display()));
/// let (store, server) = store_from_env(0, Duration::from_secs(5))?;
/// assert!(server.is_none());
/// store.set("hello", b"world")?;
/// assert_eq!(store.get("hello", Duration::from_secs(1))?, b"world");
/// std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub fn store_from_env(rank: usize, timeout: Duration) -> Result<(Arc<dyn Store>, Option<TcpStoreServer>)> {
    store_from_config(&Config::from_env()?, rank, timeout)
}

/// As [`store_from_env`], from settings already read (a communicator's options).
pub(crate) fn store_from_config(
    config: &Config,
    rank: usize,
    timeout: Duration,
) -> Result<(Arc<dyn Store>, Option<TcpStoreServer>)> {
    match store_addr(|k| config.var(k))? {
        StoreAddr::File(dir) => {
            let store = FileStore::new(dir)?;
            let store = match config.token.as_deref() {
                Some(t) if !t.is_empty() => store.with_token(t),
                _ => store,
            };
            Ok((Arc::new(store), None))
        }
        StoreAddr::Tcp { host, port } => {
            let token = config.token.as_deref().ok_or_else(|| {
                Error::Config(
                    "FERROCOMM_TOKEN is not set: the TCP store admits only clients that know the job token; \
                     export the same secret to every rank (ferrocomm-run does this for you)"
                        .into(),
                )
            })?;
            let server = if rank == 0 && !config.store_external {
                Some(TcpStoreServer::bind((host.as_str(), port), token)?)
            } else {
                None
            };
            let client = TcpStore::connect((host.as_str(), port), token, timeout)?;
            Ok((Arc::new(client), server))
        }
    }
}
