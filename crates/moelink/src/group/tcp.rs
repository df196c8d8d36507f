//! TCP rendezvous group (one process per rank), configured from torchrun's environment variables.
//! Placeholder: implemented in the foundation work (see `TcpGroup::from_env`).

use super::Group;
use crate::error::{Error, Result};

/// A group of processes connected over TCP through rank 0.
pub struct TcpGroup {
    rank: usize,
    size: usize,
}

impl TcpGroup {
    /// Connects using `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`.
    pub fn from_env() -> Result<TcpGroup> {
        Err(Error::Unavailable("TcpGroup is not implemented yet".into()))
    }
}

impl Group for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather(&self, _bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Err(Error::Unavailable("TcpGroup is not implemented yet".into()))
    }
}
