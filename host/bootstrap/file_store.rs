//! A store in a directory of a file system every rank can see (a shared file system between
//! hosts, or a local one). One file per key, written by rename so readers never see half a
//! value; read-modify-write calls hold an exclusive `flock` on a lock file.

use super::store::timeout_err;
use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A [`Store`] in a directory every rank can read and write (`FERROCOMM_STORE=file:///dir`):
/// one file per key, so no rank has to host a server. Blocking calls poll the directory.
///
/// ```
/// use ferrocomm::{FileStore, Store};
/// use std::time::Duration;
///
/// let dir = std::env::temp_dir().join(format!("ferrocomm-doc-{}", std::process::id()));
/// let (a, b) = (FileStore::new(&dir)?, FileStore::new(&dir)?); // two ranks' views
/// a.set("rank0/addr", b"10.0.0.1")?;
/// assert_eq!(b.get("rank0/addr", Duration::from_secs(1))?, b"10.0.0.1");
/// assert!(b.delete("rank0/addr")?);
/// std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub struct FileStore {
    dir: PathBuf,
    /// The job token communicators derive their secrets from, where one was given.
    token: Option<String>,
}

impl FileStore {
    /// Uses (and creates if needed) the directory `dir`.
    pub fn new(dir: impl AsRef<Path>) -> Result<FileStore> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create store directory {}", dir.display()), e))?;
        Ok(FileStore { dir, token: None })
    }

    /// Derives communicators' secrets from the job `token` (see [`Store::derive_secret`]),
    /// instead of keeping a random one as a value in the directory.
    pub fn with_token(self, token: &str) -> FileStore {
        FileStore {
            token: Some(token.to_owned()),
            ..self
        }
    }

    fn path(&self, key: &str) -> PathBuf {
        // Hex keeps any key (slashes, dots) a single safe file name.
        let name: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("k{name}"))
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.path(key)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(format!("file store read `{key}`"), e)),
        }
    }

    fn write(&self, key: &str, value: &[u8]) -> Result<()> {
        let tmp = self
            .dir
            .join(format!("tmp.{}.{}", std::process::id(), super::auth::random_token()?));
        fs::write(&tmp, value).map_err(|e| Error::io(format!("file store write `{key}`"), e))?;
        fs::rename(&tmp, self.path(key)).map_err(|e| Error::io(format!("file store rename `{key}`"), e))
    }

    /// Runs `f` while holding the store-wide exclusive lock.
    fn locked<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("lock"))
            .map_err(|e| Error::io("file store lock", e))?;
        // Released when `lock` is closed.
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| Error::io("file store flock", e.into()))?;
        let r = f();
        drop::<File>(lock);
        r
    }

    fn poll_until<R>(
        &self,
        timeout: Duration,
        key_of_wait: &str,
        mut f: impl FnMut() -> Result<Option<R>>,
    ) -> Result<R> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(200);
        loop {
            if let Some(r) = f()? {
                return Ok(r);
            }
            if Instant::now() >= deadline {
                return Err(timeout_err(key_of_wait, timeout));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.poll_until(timeout, key, || self.read(key))
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.locked(|| {
            let cur = match self.read(key)? {
                None => 0i64,
                Some(b) => std::str::from_utf8(&b)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| Error::invalid("store add", format!("value at `{key}` is not an integer")))?,
            };
            let v = cur.wrapping_add(delta);
            self.write(key, v.to_string().as_bytes())?;
            Ok(v)
        })
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.locked(|| {
            let cur = self.read(key)?;
            let matches = cur.as_deref().map_or(expected.is_empty(), |c| c == expected);
            if matches {
                self.write(key, desired)?;
                return Ok(desired.to_vec());
            }
            Ok(cur.unwrap_or_default())
        })
    }
    fn delete(&self, key: &str) -> Result<bool> {
        match fs::remove_file(self.path(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(format!("file store delete `{key}`"), e)),
        }
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for k in keys {
            let left = deadline.saturating_duration_since(Instant::now());
            self.poll_until(left, k, || Ok(self.path(k).exists().then_some(())))?;
        }
        Ok(())
    }
    fn derive_secret(&self, label: &str) -> Result<Option<[u8; 32]>> {
        Ok(self
            .token
            .as_ref()
            .map(|t| super::auth::derive(t.as_bytes(), label.as_bytes())))
    }
}
