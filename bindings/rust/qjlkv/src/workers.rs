use std::ptr::{self, NonNull};

use qjlkv_sys as sys;

use crate::error::{check, Error};

/// CPU worker threads that several caches can share ([`Cache::set_workers`](crate::Cache::set_workers)),
/// so that an engine with many caches does not start a set of threads per cache.
///
/// Each cache that uses the workers keeps them alive, so dropping this value while caches
/// still use it is fine: the threads stop when the last user is gone.
///
/// ```
/// use qjlkv::{Cache, Config, Workers};
///
/// let workers = Workers::new(0)?; // all cores
/// let config = Config::preset("q3", 2, 8, 2, 64)?.num_threads(1); // no threads of its own
/// let mut a = Cache::new(&config)?;
/// let mut b = Cache::new(&config)?;
/// a.set_workers(Some(&workers))?;
/// b.set_workers(Some(&workers))?;
/// drop(workers);
/// let kv = vec![0.5f32; 100 * a.shape().kv_token_len()];
/// a.append(0, 0, &kv, &kv)?;
/// b.append(0, 0, &kv, &kv)?;
/// # Ok::<(), qjlkv::Error>(())
/// ```
#[derive(Debug)]
pub struct Workers {
    ptr: NonNull<sys::qjlkv_workers>,
}

// SAFETY: the C contract lets caches on any threads use one set of workers at once; the
// handle itself is only passed to qjlkv_cache_set_workers (which takes a reference) and freed
// on drop, which `&self` borrows in set_workers keep from racing.
unsafe impl Send for Workers {}
// SAFETY: see Send.
unsafe impl Sync for Workers {}

impl Workers {
    /// Starts `num_threads - 1` threads (each call's own thread is the last one); 0 = the cores
    /// available; at most 1024.
    pub fn new(num_threads: u32) -> Result<Workers, Error> {
        crate::require_library_version()?;
        let mut raw = ptr::null_mut();
        // SAFETY: raw is a valid out pointer.
        check(unsafe { sys::qjlkv_workers_create(num_threads, &mut raw) })?;
        Ok(Workers { ptr: NonNull::new(raw).expect("qjlkv_workers_create returned OK and workers") })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::qjlkv_workers {
        self.ptr.as_ptr()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // SAFETY: this value owns one reference; caches hold their own.
        unsafe { sys::qjlkv_workers_destroy(self.ptr.as_ptr()) }
    }
}
