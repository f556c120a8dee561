use std::marker::PhantomData;
use std::ptr::{self, NonNull};

use qjlkv_sys as sys;

use crate::error::{check, Error};

/// The QJL sketch: an m x d `f32` matrix (m = rows, d = head_dim), immutable and shareable
/// between threads (`Send + Sync`).
///
/// An owned sketch comes from [`Sketch::new`] (`Sketch<'static>`) and is freed on drop. A
/// borrowed one comes from `Cache::sketch` and cannot outlive its cache (the lifetime `'cache`
/// is the cache's borrow; this module does not name the cache type, so that only the cache
/// depends on the sketch):
///
/// ```compile_fail
/// let cache = qjlkv::Cache::new(&qjlkv::Config::preset("qjl", 1, 4, 2, 64)?)?;
/// let sketch = cache.sketch(0)?;
/// drop(cache); // error: `cache` is still borrowed by `sketch`
/// sketch.matrix();
/// # Ok::<(), qjlkv::Error>(())
/// ```
///
/// Layer 0 of a cache with seed `s` uses exactly `Sketch::new(d, m0, s, true)`:
///
/// ```
/// use qjlkv::{Cache, Config, Sketch};
///
/// let cache = Cache::new(&Config::preset("qjl", 2, 8, 2, 64)?.seed(7))?;
/// let layer0 = cache.sketch(0)?;
/// let own = Sketch::new(64, layer0.rows(), 7, true)?;
/// assert_eq!(layer0.matrix(), own.matrix());
///
/// // Rows of one orthogonalized block are orthogonal with norm sqrt(d).
/// let m = own.matrix();
/// let dot = |i: usize, j: usize| (0..64).map(|k| f64::from(m[i * 64 + k]) * f64::from(m[j * 64 + k])).sum::<f64>();
/// assert!((dot(0, 0) - 64.0).abs() < 1e-3 && dot(0, 1).abs() < 1e-3);
/// # Ok::<(), qjlkv::Error>(())
/// ```
#[derive(Debug)]
pub struct Sketch<'cache> {
    ptr: NonNull<sys::qjlkv_sketch>,
    rows: u32,
    cols: u32,
    owned: bool,
    _cache: PhantomData<&'cache ()>,
}

// SAFETY: a sketch is immutable once created and the C contract makes it safe to use from
// any number of threads; a borrowed one cannot outlive its cache (the lifetime) and is
// never freed here.
unsafe impl Send for Sketch<'_> {}
// SAFETY: see Send: every method only reads the immutable matrix.
unsafe impl Sync for Sketch<'_> {}

impl Sketch<'static> {
    /// Creates an m x d sketch: `head_dim` in [1, 1024], `sketch_dim` (m) a positive multiple
    /// of 8 up to 65536, Philox stream 0 of `seed`; `orthogonal` makes each block of d rows
    /// orthogonal with row norm sqrt(d) (what every preset uses).
    pub fn new(head_dim: u32, sketch_dim: u32, seed: u64, orthogonal: bool) -> Result<Sketch<'static>, Error> {
        crate::require_library_version()?;
        let flags = if orthogonal { sys::QJLKV_SKETCH_ORTHOGONAL } else { 0 };
        let mut raw = ptr::null_mut();
        // SAFETY: raw is a valid out pointer.
        check(unsafe { sys::qjlkv_sketch_create(head_dim, sketch_dim, seed, flags, &mut raw) })?;
        let ptr = NonNull::new(raw).expect("qjlkv_sketch_create returned OK and a sketch");
        // SAFETY: ptr is a live sketch that this value owns from here on.
        unsafe { Sketch::from_ptr(ptr, true) }
    }
}

impl<'cache> Sketch<'cache> {
    /// # Safety
    /// `ptr` must be a live sketch that stays alive for `'cache` (borrowed) or that the
    /// returned value owns and frees (owned).
    pub(crate) unsafe fn from_ptr(ptr: NonNull<sys::qjlkv_sketch>, owned: bool) -> Result<Sketch<'cache>, Error> {
        let mut sketch = Sketch {
            ptr,
            rows: 0,
            cols: 0,
            owned,
            _cache: PhantomData,
        };
        // SAFETY: ptr is live; rows and cols are valid out pointers.
        check(unsafe { sys::qjlkv_sketch_shape(ptr.as_ptr(), &mut sketch.rows, &mut sketch.cols) })?;
        Ok(sketch)
    }

    /// m, the number of rows.
    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// d, the number of columns (the head dimension).
    pub fn cols(&self) -> u32 {
        self.cols
    }

    /// The matrix the kernels use, row-major m x d.
    pub fn matrix(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.matrix_into(&mut out)
            .expect("a buffer of rows * cols floats is accepted");
        out
    }

    /// Writes the matrix into `out`, which must hold exactly `rows * cols` floats.
    pub fn matrix_into(&self, out: &mut [f32]) -> Result<(), Error> {
        if out.len() != self.len() {
            return Err(Error::invalid(format!(
                "out: length {} does not match the sketch's rows * cols = {} * {} = {}",
                out.len(),
                self.rows,
                self.cols,
                self.len()
            )));
        }
        // SAFETY: the sketch is live and out holds out.len() writable floats.
        check(unsafe { sys::qjlkv_sketch_matrix(self.ptr.as_ptr(), out.as_mut_ptr(), out.len()) })
    }

    fn len(&self) -> usize {
        self.rows as usize * self.cols as usize
    }

    /// The C handle, for calls through `qjlkv-sys`. Do not destroy it.
    pub fn as_ptr(&self) -> *const sys::qjlkv_sketch {
        self.ptr.as_ptr()
    }
}

impl Drop for Sketch<'_> {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: this value owns the sketch and nothing else references it any more.
            unsafe { sys::qjlkv_sketch_destroy(self.ptr.as_ptr()) }
        }
    }
}
