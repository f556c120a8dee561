use std::ffi::CStr;
use std::fmt;

use qjlkv_sys as sys;

/// Why a call failed: the C library's `qjlkv_status`.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// A bad size, range, config or data (`QJLKV_ERROR_INVALID_ARGUMENT`).
    InvalidArgument,
    /// An allocation failed; nothing changed (`QJLKV_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// Valid, but not available in this build or with this API (`QJLKV_ERROR_UNSUPPORTED`).
    Unsupported,
    /// The CUDA runtime reported an error (`QJLKV_ERROR_DEVICE`).
    Device,
    /// Internal state failed a consistency check (`QJLKV_ERROR_CORRUPT_DATA`).
    CorruptData,
    /// A bug in the library (`QJLKV_ERROR_INTERNAL`).
    Internal,
    /// The call would take the cache's `bytes_used` above [`Config::memory_budget`]
    /// (`QJLKV_ERROR_MEMORY_BUDGET`); nothing changed. Unlike [`OutOfMemory`](Status::OutOfMemory)
    /// this is the cache's own limit, not a failed allocation: free or preempt a sequence
    /// (`clear_sequence`, `truncate`), then retry.
    ///
    /// [`Config::memory_budget`]: crate::Config::memory_budget
    MemoryBudget,
    /// A status this version of the crate does not know (from a newer library).
    Other(u32),
}

impl Status {
    pub(crate) fn from_raw(raw: sys::qjlkv_status) -> Status {
        match raw {
            sys::QJLKV_ERROR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::QJLKV_ERROR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::QJLKV_ERROR_UNSUPPORTED => Status::Unsupported,
            sys::QJLKV_ERROR_DEVICE => Status::Device,
            sys::QJLKV_ERROR_CORRUPT_DATA => Status::CorruptData,
            sys::QJLKV_ERROR_INTERNAL => Status::Internal,
            sys::QJLKV_ERROR_MEMORY_BUDGET => Status::MemoryBudget,
            other => Status::Other(other),
        }
    }

    /// The C status code.
    pub fn code(self) -> u32 {
        match self {
            Status::InvalidArgument => sys::QJLKV_ERROR_INVALID_ARGUMENT,
            Status::OutOfMemory => sys::QJLKV_ERROR_OUT_OF_MEMORY,
            Status::Unsupported => sys::QJLKV_ERROR_UNSUPPORTED,
            Status::Device => sys::QJLKV_ERROR_DEVICE,
            Status::CorruptData => sys::QJLKV_ERROR_CORRUPT_DATA,
            Status::Internal => sys::QJLKV_ERROR_INTERNAL,
            Status::MemoryBudget => sys::QJLKV_ERROR_MEMORY_BUDGET,
            Status::Other(code) => code,
        }
    }

    /// The C name of the status, e.g. `"QJLKV_ERROR_INVALID_ARGUMENT"`.
    pub fn name(self) -> &'static str {
        // SAFETY: qjlkv_status_string never returns NULL and returns a static string.
        let name = unsafe { CStr::from_ptr(sys::qjlkv_status_string(self.code())) };
        name.to_str().unwrap_or("unknown status")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed call: the status and the human-readable reason, which names the argument and
/// the values that were wrong.
///
/// Failures detected by the library carry its message (`qjlkv_last_error_message()`);
/// slice lengths and element types are checked by this crate before calling the library,
/// with messages of the same style.
///
/// ```
/// let err = qjlkv::Config::preset("qjl", 1, 8, 3, 64).unwrap_err();
/// assert_eq!(err.status(), qjlkv::Status::InvalidArgument);
/// assert!(err.message().contains("num_kv_heads"));
/// println!("{err}"); // "num_q_heads (8) is not a multiple of ... (QJLKV_ERROR_INVALID_ARGUMENT)"
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    /// An error raised by this crate's own argument checks.
    pub(crate) fn invalid(message: String) -> Error {
        Error {
            status: Status::InvalidArgument,
            message,
        }
    }

    pub(crate) fn new(status: Status, message: String) -> Error {
        Error { status, message }
    }

    /// The status of the failure.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The reason, naming the argument that was wrong.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for Error {}

/// Turns a status into a `Result`, reading this thread's last error message on failure.
pub(crate) fn check(raw: sys::qjlkv_status) -> Result<(), Error> {
    if raw == sys::QJLKV_OK {
        return Ok(());
    }
    // SAFETY: the message is thread-local, never NULL, and valid until the next failing
    // call on this thread; it is copied before anything else runs.
    let message = unsafe { CStr::from_ptr(sys::qjlkv_last_error_message()) };
    Err(Error {
        status: Status::from_raw(raw),
        message: message.to_string_lossy().into_owned(),
    })
}
