//! Export and import of one sequence (`qjlkv_cache_export*`, `qjlkv_cache_import*`): the
//! checksummed stream of docs/FORMAT.md, through byte slices or `std::io::Write`/`Read`.

use std::any::Any;
use std::ffi::c_void;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};

use qjlkv_sys as sys;

use crate::cache::Cache;
use crate::error::{check, Error, Status};

fn layer_range(layers: &Range<u32>) -> Result<(u32, u32), Error> {
    if layers.end < layers.start {
        return Err(Error::invalid(format!(
            "layers is {}..{}: the end comes before the start",
            layers.start, layers.end
        )));
    }
    Ok((layers.start, layers.end - layers.start))
}

/// A library error as an `io::Error` (kind InvalidData for a corrupt stream, InvalidInput for
/// a bad argument or mismatched config); `get_ref()` downcasts to the `qjlkv::Error`.
fn to_io(error: Error) -> io::Error {
    let kind = match error.status() {
        Status::CorruptData => io::ErrorKind::InvalidData,
        Status::InvalidArgument => io::ErrorKind::InvalidInput,
        Status::OutOfMemory => io::ErrorKind::OutOfMemory,
        // An import that the cache's memory budget refuses.
        Status::MemoryBudget => io::ErrorKind::QuotaExceeded,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, error)
}

/// What a callback saw: the first I/O error or panic, re-raised once the C call returned.
struct CallbackState<T> {
    inner: T,
    transferred: u64,
    io_error: Option<io::Error>,
    panic: Option<Box<dyn Any + Send>>,
}

impl<T> CallbackState<T> {
    fn new(inner: T) -> Self {
        CallbackState {
            inner,
            transferred: 0,
            io_error: None,
            panic: None,
        }
    }

    fn finish(self, status: Result<(), Error>) -> io::Result<u64> {
        if let Some(payload) = self.panic {
            panic::resume_unwind(payload);
        }
        if let Some(e) = self.io_error {
            return Err(e);
        }
        status.map_err(to_io)?;
        Ok(self.transferred)
    }
}

unsafe extern "C" fn write_piece<W: Write>(user: *mut c_void, data: *const c_void, size: usize) -> usize {
    // SAFETY: user is the &mut CallbackState<&mut W> passed to export_stream below, alive for
    // the call; data holds size bytes for the duration of this callback.
    let state = &mut *(user as *mut CallbackState<&mut W>);
    let bytes = std::slice::from_raw_parts(data as *const u8, size);
    match panic::catch_unwind(AssertUnwindSafe(|| state.inner.write_all(bytes))) {
        Ok(Ok(())) => {
            state.transferred += size as u64;
            size
        }
        Ok(Err(e)) => {
            state.io_error = Some(e);
            0
        }
        Err(payload) => {
            state.panic = Some(payload);
            0
        }
    }
}

unsafe extern "C" fn read_piece<R: Read>(user: *mut c_void, data: *mut c_void, size: usize) -> usize {
    // SAFETY: as write_piece; data is writable for size bytes.
    let state = &mut *(user as *mut CallbackState<&mut R>);
    let out = std::slice::from_raw_parts_mut(data as *mut u8, size);
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let mut done = 0;
        while done < out.len() {
            match state.inner.read(&mut out[done..]) {
                Ok(0) => break, // end of the stream: the library reports the truncation
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }));
    match result {
        Ok(Ok(n)) => {
            state.transferred += n as u64;
            n
        }
        Ok(Err(e)) => {
            state.io_error = Some(e);
            0
        }
        Err(payload) => {
            state.panic = Some(payload);
            0
        }
    }
}

impl Cache {
    /// The exact size in bytes of the stream [`export`](Cache::export) writes for sequence
    /// `seq`, layers `layers`.
    pub fn export_size(&self, seq: u32, layers: Range<u32>) -> Result<u64, Error> {
        let (first, count) = layer_range(&layers)?;
        let mut size = 0u64;
        // SAFETY: the cache is live; size is a valid out pointer.
        check(unsafe { sys::qjlkv_cache_export_size(self.as_ptr(), seq, first, count, &mut size) })?;
        Ok(size)
    }

    /// Sequence `seq` in layers `layers` (e.g. `0..num_layers`) as a stream (docs/FORMAT.md).
    ///
    /// ```
    /// # use qjlkv::{Cache, Config};
    /// let cfg = Config::preset("kivi", 2, 4, 2, 32)?;
    /// let mut a = Cache::new(&cfg)?;
    /// a.append(0, 7, &vec![0.5f32; 3 * 2 * 32], &vec![1.0f32; 3 * 2 * 32])?;
    /// let stream = a.export(7, 0..2)?;
    /// let mut b = Cache::new(&cfg)?;
    /// b.import(7, &stream)?;
    /// assert_eq!(b.length(0, 7)?, 3);
    /// # Ok::<(), qjlkv::Error>(())
    /// ```
    pub fn export(&self, seq: u32, layers: Range<u32>) -> Result<Vec<u8>, Error> {
        let size = self.export_size(seq, layers.clone())?;
        let size = usize::try_from(size)
            .map_err(|_| Error::new(Status::OutOfMemory, format!("the stream takes {size} bytes")))?;
        let mut out = vec![0u8; size];
        // SAFETY: out holds exactly the size the library reported for these arguments.
        check(unsafe {
            sys::qjlkv_cache_export(
                self.as_ptr(),
                seq,
                layers.start,
                layers.end - layers.start,
                out.as_mut_ptr() as *mut c_void,
                size as u64,
            )
        })?;
        Ok(out)
    }

    /// Writes the stream of sequence `seq`, layers `layers`, to `writer` in pieces of at most
    /// 64 KiB (the stream is never held whole); returns the bytes written. An error of the
    /// writer is returned as is; a library error as an `io::Error` wrapping the
    /// [`Error`] (`InvalidInput`: bad arguments; `InvalidData`: corrupt data).
    pub fn export_to<W: Write>(&self, seq: u32, layers: Range<u32>, writer: &mut W) -> io::Result<u64> {
        let (first, count) = layer_range(&layers).map_err(to_io)?;
        let mut state = CallbackState::new(writer);
        // SAFETY: the callback receives a pointer to state, which outlives the call.
        let status = check(unsafe {
            sys::qjlkv_cache_export_stream(
                self.as_ptr(),
                seq,
                first,
                count,
                Some(write_piece::<W>),
                &mut state as *mut CallbackState<&mut W> as *mut c_void,
            )
        });
        state.finish(status)
    }

    /// Imports a stream (exactly `stream.len()` bytes) into sequence `seq`, which must be empty
    /// in the stream's layers. On failure nothing changes: `CorruptData` for damaged or
    /// truncated streams, `InvalidArgument` for another format version, a config that does not
    /// match (the message names the field) or a non-empty target; `MemoryBudget` for a
    /// stream that would take the cache above [`Config::memory_budget`](crate::Config::memory_budget).
    pub fn import(&mut self, seq: u32, stream: &[u8]) -> Result<(), Error> {
        // A non-null pointer even for an empty slice: the library refuses NULL.
        let data = if stream.is_empty() {
            [0u8; 1].as_ptr()
        } else {
            stream.as_ptr()
        };
        // SAFETY: the cache is live and exclusively borrowed; data holds stream.len() bytes.
        check(unsafe { sys::qjlkv_cache_import(self.as_mut_ptr(), seq, data as *const c_void, stream.len() as u64) })
    }

    /// Reads one stream from `reader` into sequence `seq`: exactly the stream's bytes, so
    /// several streams written one after another are read by as many calls. Errors as
    /// [`import`](Cache::import), wrapped in `io::Error` like [`export_to`](Cache::export_to)
    /// (`QuotaExceeded`: the memory budget); an error of the reader is returned as is.
    pub fn import_from<R: Read>(&mut self, seq: u32, reader: &mut R) -> io::Result<u64> {
        let mut state = CallbackState::new(reader);
        // SAFETY: as export_to.
        let status = check(unsafe {
            sys::qjlkv_cache_import_stream(
                self.as_mut_ptr(),
                seq,
                Some(read_piece::<R>),
                &mut state as *mut CallbackState<&mut R> as *mut c_void,
            )
        });
        state.finish(status)
    }
}
