//! The data connections of one session: attached by connect and accept tasks, taken by
//! fences, closes and shutdown, which race each other.

/// The data connections of one session and whether the session is closing.
///
/// Rules: a connection attached while the session is open is handed out by exactly one
/// later [`ConnSet::fence`] or [`ConnSet::close`]; once closing, [`ConnSet::attach`] refuses
/// (the caller closes the connection itself), so nothing is left attached to a closed session.
#[derive(Debug)]
pub struct ConnSet<C> {
    conns: Vec<C>,
    closing: bool,
}

impl<C> Default for ConnSet<C> {
    fn default() -> Self {
        ConnSet {
            conns: Vec::new(),
            closing: false,
        }
    }
}

impl<C> ConnSet<C> {
    /// Adds a connection; gives it back if the session is closing.
    pub fn attach(&mut self, conn: C) -> Result<(), C> {
        if self.closing {
            return Err(conn);
        }
        self.conns.push(conn);
        Ok(())
    }

    /// A fence: takes every connection (the caller closes them); later ones may attach.
    pub fn fence(&mut self) -> Vec<C> {
        std::mem::take(&mut self.conns)
    }

    /// A close: takes every connection and refuses any later one. `None` if already closing.
    pub fn close(&mut self) -> Option<Vec<C>> {
        if self.closing {
            return None;
        }
        self.closing = true;
        Some(std::mem::take(&mut self.conns))
    }

    /// Whether [`ConnSet::close`] ran.
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// The attached connections.
    pub fn iter(&self) -> std::slice::Iter<'_, C> {
        self.conns.iter()
    }

    /// The attached connections, mutably.
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, C> {
        self.conns.iter_mut()
    }

    /// Number of attached connections.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Whether no connection is attached.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Keeps only the connections for which `keep` holds (drops finished ones).
    pub fn retain(&mut self, keep: impl FnMut(&C) -> bool) {
        self.conns.retain(keep);
    }
}
