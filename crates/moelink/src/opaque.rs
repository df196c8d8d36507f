//! What a backend leaves in a handle, a plan or a hook, carried by the core without knowing its type: each
//! backend (and each fabric of the CUDA backend) owns its routing, plan and receive-phase types, and only it
//! reads them back.

use std::any::Any;

use crate::error::{Error, Result};

/// A backend's data of one handle or plan. `owner` names the kind of buffer that made it, for the error a
/// mismatch gives (the core already refuses handles of another buffer, so this is the last line).
pub(crate) struct BackendData {
    owner: &'static str,
    value: Box<dyn Any + Send + Sync>,
}

impl BackendData {
    pub(crate) fn new<T: Any + Send + Sync>(owner: &'static str, value: T) -> BackendData {
        BackendData { owner, value: Box::new(value) }
    }

    /// The data as the `T` that `reader` (the kind of buffer reading it) made, or an error naming `arg`.
    pub(crate) fn get<T: Any>(&self, arg: &'static str, rank: usize, reader: &'static str) -> Result<&T> {
        self.value.downcast_ref::<T>().ok_or_else(|| self.mismatch(arg, rank, reader))
    }

    /// As [`BackendData::get`], by value.
    pub(crate) fn take<T: Any>(self, arg: &'static str, rank: usize, reader: &'static str) -> Result<T> {
        if !self.value.is::<T>() {
            return Err(self.mismatch(arg, rank, reader));
        }
        Ok(*self.value.downcast::<T>().expect("checked above"))
    }

    fn mismatch(&self, arg: &'static str, rank: usize, reader: &'static str) -> Error {
        Error::invalid(arg, rank, format!("comes from a {} buffer, not from this {reader} buffer", self.owner))
    }
}

/// A receive phase a backend handed out (`return_recv_hook`), holding the outputs it writes until it runs.
pub(crate) trait RecvPhase {
    /// Runs the phase on `backend`, the backend that made it (as `Any`: the phase finds its own type).
    fn run(self: Box<Self>, backend: &mut dyn Any, rank: usize) -> Result<()>;
}

/// A boxed [`RecvPhase`] (`Send`: a hook may run on another thread than the call that made it).
pub(crate) struct PendingRecv<'a>(Box<dyn RecvPhase + Send + 'a>);

impl<'a> PendingRecv<'a> {
    pub(crate) fn new(phase: impl RecvPhase + Send + 'a) -> PendingRecv<'a> {
        PendingRecv(Box::new(phase))
    }

    pub(crate) fn run(self, backend: &mut dyn Any, rank: usize) -> Result<()> {
        self.0.run(backend, rank)
    }
}

/// The backend of type `B` a [`RecvPhase`] runs on, or an error naming the hook.
pub(crate) fn backend_of<'b, B: Any>(backend: &'b mut dyn Any, rank: usize, owner: &'static str) -> Result<&'b mut B> {
    backend.downcast_mut::<B>().ok_or_else(|| Error::invalid("hook", rank, format!("comes from a {owner} buffer, not from this one")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_comes_back_only_as_its_own_type() {
        let d = BackendData::new("host", 7u32);
        assert_eq!(*d.get::<u32>("handle", 0, "host").unwrap(), 7);
        let e = d.get::<u64>("handle", 3, "CUDA").unwrap_err();
        assert_eq!(e.argument(), Some("handle"));
        assert!(e.to_string().contains("host buffer") && e.to_string().contains("rank 3"), "{e}");
        assert!(d.take::<String>("plan", 0, "CUDA").is_err());
        assert_eq!(BackendData::new("host", 5u8).take::<u8>("plan", 0, "host").unwrap(), 5);
    }

    struct Phase<'a>(&'a mut u32);
    impl RecvPhase for Phase<'_> {
        fn run(self: Box<Self>, backend: &mut dyn Any, rank: usize) -> Result<()> {
            *self.0 += *backend_of::<u32>(backend, rank, "test")?;
            Ok(())
        }
    }

    #[test]
    fn a_phase_runs_on_its_own_backend_only() {
        let mut out = 1;
        PendingRecv::new(Phase(&mut out)).run(&mut 41u32, 0).unwrap();
        assert_eq!(out, 42);
        assert_eq!(PendingRecv::new(Phase(&mut out)).run(&mut 1u8, 2).unwrap_err().argument(), Some("hook"));
    }
}
