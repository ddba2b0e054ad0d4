//! The on-disk cache of compiled kernels: one CUBIN per (source file, architecture), named by a hash of
//! everything that decides its contents (all sources and headers, compile options, architecture, driver
//! and NVRTC versions, this crate's version).
//!
//! Directory: a `kernels/` folder inside the root the caller names
//! ([`CompileOptions::cache_dir`](crate::registry::CompileOptions::cache_dir); the `sanmai` binary:
//! `$SANMAI_CACHE_DIR`, else `$XDG_CACHE_HOME/sanmai`, else `~/.cache/sanmai`). A cache that cannot
//! be read or written is skipped, never an error.

use std::path::Path;

/// A 128-bit FNV-1a style hash (two independent 64-bit lanes), stable across runs and platforms.
#[derive(Clone)]
pub struct KeyHasher {
    a: u64,
    b: u64,
}

impl Default for KeyHasher {
    fn default() -> Self {
        Self {
            a: 0xcbf2_9ce4_8422_2325,
            b: 0x6c62_272e_07bb_0142,
        }
    }
}

impl KeyHasher {
    /// Adds a length-prefixed field, so that field boundaries count.
    pub fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes)
    }

    fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for &x in bytes {
            self.a = (self.a ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
            self.b = (self.b ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
            self.b = self.b.rotate_left(5);
        }
        self
    }

    pub fn hex(&self) -> String {
        format!("{:016x}{:016x}", self.a, self.b)
    }
}

/// Reads a cached file, if present.
pub fn load(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok().filter(|b| !b.is_empty())
}

/// Writes a file atomically (temporary file, then rename); failures are logged and ignored.
pub fn store(path: &Path, bytes: &[u8]) {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        tracing::warn!("kernel cache: cannot write {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_fields_and_boundaries() {
        let h = |parts: &[&[u8]]| {
            let mut k = KeyHasher::default();
            for p in parts {
                k.field(p);
            }
            k.hex()
        };
        assert_eq!(h(&[b"ab", b"c"]), h(&[b"ab", b"c"]));
        assert_ne!(h(&[b"ab", b"c"]), h(&[b"a", b"bc"]));
        assert_ne!(h(&[b"sm_86"]), h(&[b"sm_90"]));
        assert_eq!(h(&[]).len(), 32);
    }

    #[test]
    fn store_then_load_round_trips() {
        let dir = std::env::temp_dir().join(format!("sanmai-cache-test-{}", std::process::id()));
        let path = dir.join("kernels").join("x.cubin");
        store(&path, b"cubin bytes");
        assert_eq!(load(&path).as_deref(), Some(&b"cubin bytes"[..]));
        assert_eq!(load(&dir.join("missing")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
