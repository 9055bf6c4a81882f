//! Bootstrap: the rendezvous store and discovery of this process's place in the job.
//!
//! May import: the contracts.

pub(crate) mod accept;
mod auth;
mod env;
mod file_store;
mod store;
mod tcp_store;
mod wire;

pub use auth::random_token;
pub use env::{discover, store_addr, RankInfo, StoreAddr};
pub use file_store::FileStore;
pub(crate) use store::{all_gather, all_gather_records};
pub use store::{MemoryStore, PrefixStore, Store};
#[cfg(feature = "fuzzing")]
pub use tcp_store::fuzz_one_request;
pub use tcp_store::{TcpStore, TcpStoreServer};
pub use wire::DEFAULT_MAX_FRAME;

pub(crate) use auth::{nonce, proof, verify, NONCE_BYTES, PROOF_BYTES};

use crate::contracts::error::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

/// The job store as the environment describes it. Rank 0 hosts the TCP store server unless
/// `FERROCOMM_STORE_EXTERNAL=1` says a launcher already does (ferrocomm-run sets it).
pub fn store_from_env(rank: usize, timeout: Duration) -> Result<(Arc<dyn Store>, Option<TcpStoreServer>)> {
    let var = |k: &str| std::env::var(k).ok();
    match store_addr(var)? {
        StoreAddr::File(dir) => Ok((Arc::new(FileStore::new(dir)?), None)),
        StoreAddr::Tcp { host, port } => {
            let token = var("FERROCOMM_TOKEN").filter(|t| !t.is_empty()).ok_or_else(|| {
                Error::Config(
                    "FERROCOMM_TOKEN is not set: the TCP store admits only clients that know the job token; \
                     export the same secret to every rank (ferrocomm-run does this for you)"
                        .into(),
                )
            })?;
            let external = var("FERROCOMM_STORE_EXTERNAL").is_some_and(|v| v == "1");
            let server = if rank == 0 && !external {
                Some(TcpStoreServer::bind((host.as_str(), port), &token)?)
            } else {
                None
            };
            let client = TcpStore::connect((host.as_str(), port), &token, timeout)?;
            Ok((Arc::new(client), server))
        }
    }
}
