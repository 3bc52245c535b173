//! Protocol Buffers, as far as the server needs them: the wire format, decoding of the built-in
//! types clients send as `application/vnd.kubernetes.protobuf` (the `k8s\0` envelope around a
//! `runtime.Unknown` holding the type's message), and the writer for the OpenAPI v2 document.
//!
//! Messages are described by field tables taken from the types' `generated.proto`; a field the
//! table does not know fails the request with its number and message named, so nothing a client
//! sends is ever dropped silently. Hand-written tables for the few types kubectl's generators
//! send keep this small; a generated crate of every Kubernetes type would bring a code generator
//! and a second object model for the same JSON.

use serde_json::{Map, Value, json};

use super::meta;

/// A protobuf body the server cannot turn into an object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// Not the wire format, or not the `k8s\0` envelope.
    #[error("malformed protobuf body: {0}")]
    Malformed(String),
    /// A type, or a field of a type, this server has no table for.
    #[error("{0} (send JSON instead)")]
    Unsupported(String),
}

fn malformed(what: &str) -> ProtoError {
    ProtoError::Malformed(what.to_owned())
}

/// One field's value on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

fn read_varint(buf: &[u8], pos: &mut usize) -> Result<u64, ProtoError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos).ok_or_else(|| malformed("truncated varint"))?;
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(malformed("varint longer than 10 bytes"))
}

/// The fields of one message, in wire order.
fn fields(buf: &[u8]) -> Result<Vec<(u32, Wire<'_>)>, ProtoError> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let key = read_varint(buf, &mut pos)?;
        let number = u32::try_from(key >> 3).map_err(|_| malformed("field number"))?;
        let take = |pos: &mut usize, n: usize| -> Result<&[u8], ProtoError> {
            let end = pos.checked_add(n).filter(|e| *e <= buf.len());
            let end = end.ok_or_else(|| malformed("truncated field"))?;
            let s = &buf[*pos..end];
            *pos = end;
            Ok(s)
        };
        let value = match key & 7 {
            0 => Wire::Varint(read_varint(buf, &mut pos)?),
            1 => Wire::Fixed64(u64::from_le_bytes(
                take(&mut pos, 8)?.try_into().expect("8 bytes"),
            )),
            2 => {
                let n = usize::try_from(read_varint(buf, &mut pos)?)
                    .map_err(|_| malformed("length"))?;
                Wire::Bytes(take(&mut pos, n)?)
            }
            5 => Wire::Fixed32(u32::from_le_bytes(
                take(&mut pos, 4)?.try_into().expect("4 bytes"),
            )),
            t => return Err(ProtoError::Malformed(format!("wire type {t}"))),
        };
        out.push((number, value));
    }
    Ok(out)
}

/// How a field maps to JSON. Go clients send every scalar of a message, set or not; the JSON
/// form leaves out what Go's `omitempty` leaves out (empty strings, zero plain integers, zero
/// times), while pointer fields (`OptInt`, and every `bool` here) keep an explicit zero.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Str,
    Bool,
    Int,
    OptInt,
    Msg(&'static Message),
    /// `metav1.Time`: RFC 3339, seconds.
    Time,
    RepStr,
    RepMsg(&'static Message),
    MapStr,
    /// `map<string, bytes>`, values base64 in JSON.
    MapBytes,
    /// Read and dropped: the server discards the field anyway (`managedFields`).
    Ignored,
}

/// A message's fields: number, JSON name, kind.
#[derive(Debug)]
struct Message {
    name: &'static str,
    fields: &'static [(u32, &'static str, Kind)],
}

use Kind::*;

static OWNER_REFERENCE: Message = Message {
    name: "k8s.io.apimachinery.pkg.apis.meta.v1.OwnerReference",
    fields: &[
        (1, "kind", Str),
        (3, "name", Str),
        (4, "uid", Str),
        (5, "apiVersion", Str),
        (6, "controller", Bool),
        (7, "blockOwnerDeletion", Bool),
    ],
};

static OBJECT_META: Message = Message {
    name: "k8s.io.apimachinery.pkg.apis.meta.v1.ObjectMeta",
    fields: &[
        (1, "name", Str),
        (2, "generateName", Str),
        (3, "namespace", Str),
        (4, "selfLink", Str),
        (5, "uid", Str),
        (6, "resourceVersion", Str),
        (7, "generation", Int),
        (8, "creationTimestamp", Time),
        (9, "deletionTimestamp", Time),
        (10, "deletionGracePeriodSeconds", OptInt),
        (11, "labels", MapStr),
        (12, "annotations", MapStr),
        (13, "ownerReferences", RepMsg(&OWNER_REFERENCE)),
        (14, "finalizers", RepStr),
        (17, "managedFields", Ignored),
    ],
};

static CONFIG_MAP: Message = Message {
    name: "k8s.io.api.core.v1.ConfigMap",
    fields: &[
        (1, "metadata", Msg(&OBJECT_META)),
        (2, "data", MapStr),
        (3, "binaryData", MapBytes),
        (4, "immutable", Bool),
    ],
};

static SECRET: Message = Message {
    name: "k8s.io.api.core.v1.Secret",
    fields: &[
        (1, "metadata", Msg(&OBJECT_META)),
        (2, "data", MapBytes),
        (3, "type", Str),
        (4, "stringData", MapStr),
        (5, "immutable", Bool),
    ],
};

static NAMESPACE_SPEC: Message = Message {
    name: "k8s.io.api.core.v1.NamespaceSpec",
    fields: &[(1, "finalizers", RepStr)],
};

static NAMESPACE_STATUS: Message = Message {
    name: "k8s.io.api.core.v1.NamespaceStatus",
    fields: &[(1, "phase", Str)],
};

static NAMESPACE: Message = Message {
    name: "k8s.io.api.core.v1.Namespace",
    fields: &[
        (1, "metadata", Msg(&OBJECT_META)),
        (2, "spec", Msg(&NAMESPACE_SPEC)),
        (3, "status", Msg(&NAMESPACE_STATUS)),
    ],
};

static OBJECT_REFERENCE: Message = Message {
    name: "k8s.io.api.core.v1.ObjectReference",
    fields: &[
        (1, "kind", Str),
        (2, "namespace", Str),
        (3, "name", Str),
        (4, "uid", Str),
        (5, "apiVersion", Str),
        (6, "resourceVersion", Str),
        (7, "fieldPath", Str),
    ],
};

static LOCAL_OBJECT_REFERENCE: Message = Message {
    name: "k8s.io.api.core.v1.LocalObjectReference",
    fields: &[(1, "name", Str)],
};

static SERVICE_ACCOUNT: Message = Message {
    name: "k8s.io.api.core.v1.ServiceAccount",
    fields: &[
        (1, "metadata", Msg(&OBJECT_META)),
        (2, "secrets", RepMsg(&OBJECT_REFERENCE)),
        (3, "imagePullSecrets", RepMsg(&LOCAL_OBJECT_REFERENCE)),
        (4, "automountServiceAccountToken", Bool),
    ],
};

static PRECONDITIONS: Message = Message {
    name: "k8s.io.apimachinery.pkg.apis.meta.v1.Preconditions",
    fields: &[(1, "uid", Str), (2, "resourceVersion", Str)],
};

static DELETE_OPTIONS: Message = Message {
    name: "k8s.io.apimachinery.pkg.apis.meta.v1.DeleteOptions",
    fields: &[
        (1, "gracePeriodSeconds", OptInt),
        (2, "preconditions", Msg(&PRECONDITIONS)),
        (3, "orphanDependents", Bool),
        (4, "propagationPolicy", Str),
        (5, "dryRun", RepStr),
    ],
};

/// The types accepted in protobuf, by `apiVersion` and `kind`.
static TYPES: &[(&str, &str, &Message)] = &[
    ("v1", "ConfigMap", &CONFIG_MAP),
    ("v1", "Secret", &SECRET),
    ("v1", "Namespace", &NAMESPACE),
    ("v1", "ServiceAccount", &SERVICE_ACCOUNT),
    ("v1", "DeleteOptions", &DELETE_OPTIONS),
    ("meta.k8s.io/v1", "DeleteOptions", &DELETE_OPTIONS),
];

fn string(b: &[u8], msg: &Message, field: &str) -> Result<String, ProtoError> {
    String::from_utf8(b.to_vec())
        .map_err(|_| ProtoError::Malformed(format!("{}.{field} is not UTF-8", msg.name)))
}

fn base64(b: &[u8]) -> Value {
    use base64::Engine;
    json!(base64::engine::general_purpose::STANDARD.encode(b))
}

/// A `map<string, V>` entry: key = 1, value = 2.
fn map_entry(b: &[u8]) -> Result<(&[u8], &[u8]), ProtoError> {
    let (mut k, mut v): (&[u8], &[u8]) = (&[], &[]);
    for (n, w) in fields(b)? {
        match (n, w) {
            (1, Wire::Bytes(x)) => k = x,
            (2, Wire::Bytes(x)) => v = x,
            _ => return Err(malformed("map entry")),
        }
    }
    Ok((k, v))
}

/// A `metav1.Time`; the zero time (an empty message) is `None`, as it is `null` in JSON.
fn time(b: &[u8]) -> Result<Option<Value>, ProtoError> {
    if b.is_empty() {
        return Ok(None);
    }
    let mut secs = 0i64;
    for (n, w) in fields(b)? {
        match (n, w) {
            #[allow(clippy::cast_possible_wrap)]
            (1, Wire::Varint(s)) => secs = s as i64,
            (2, Wire::Varint(_)) => {}
            _ => return Err(malformed("Time")),
        }
    }
    let t = time::OffsetDateTime::from_unix_timestamp(secs).map_err(|_| malformed("Time"))?;
    Ok(Some(json!(meta::timestamp(t))))
}

fn decode_message(buf: &[u8], msg: &Message) -> Result<Value, ProtoError> {
    let mut out = Map::new();
    for (n, w) in fields(buf)? {
        let Some((_, name, kind)) = msg.fields.iter().find(|(f, ..)| *f == n) else {
            return Err(ProtoError::Unsupported(format!(
                "field {n} of {} is not supported by this server in protobuf",
                msg.name
            )));
        };
        let bad = || ProtoError::Malformed(format!("{}.{name}: unexpected wire type", msg.name));
        match (kind, w) {
            (Ignored, _) => {}
            (Str, Wire::Bytes(b)) => {
                if !b.is_empty() {
                    out.insert((*name).into(), json!(string(b, msg, name)?));
                }
            }
            (Bool, Wire::Varint(v)) => {
                out.insert((*name).into(), json!(v != 0));
            }
            #[allow(clippy::cast_possible_wrap)]
            (Int | OptInt, Wire::Varint(v)) => {
                if v != 0 || matches!(kind, OptInt) {
                    out.insert((*name).into(), json!(v as i64));
                }
            }
            (Msg(m), Wire::Bytes(b)) => {
                out.insert((*name).into(), decode_message(b, m)?);
            }
            (Time, Wire::Bytes(b)) => {
                if let Some(t) = time(b)? {
                    out.insert((*name).into(), t);
                }
            }
            (RepStr, Wire::Bytes(b)) => {
                let s = string(b, msg, name)?;
                push(entry(&mut out, name), json!(s));
            }
            (RepMsg(m), Wire::Bytes(b)) => {
                let v = decode_message(b, m)?;
                push(entry(&mut out, name), v);
            }
            (MapStr | MapBytes, Wire::Bytes(b)) => {
                let (k, v) = map_entry(b)?;
                let k = string(k, msg, name)?;
                let v = match kind {
                    MapStr => json!(string(v, msg, name)?),
                    _ => base64(v),
                };
                let e = entry(&mut out, name);
                if !e.is_object() {
                    *e = json!({});
                }
                e[k] = v;
            }
            _ => return Err(bad()),
        }
    }
    Ok(Value::Object(out))
}

fn entry<'a>(out: &'a mut Map<String, Value>, name: &str) -> &'a mut Value {
    out.entry(name.to_owned()).or_insert(Value::Null)
}

fn push(slot: &mut Value, v: Value) {
    match slot {
        Value::Array(a) => a.push(v),
        _ => *slot = json!([v]),
    }
}

/// The media type of Kubernetes protobuf bodies.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// Decodes a `application/vnd.kubernetes.protobuf` body into the JSON form of the object.
pub fn decode_object(body: &[u8]) -> Result<Value, ProtoError> {
    let inner = body
        .strip_prefix(b"k8s\x00")
        .ok_or_else(|| malformed("missing the k8s\\x00 prefix"))?;
    // runtime.Unknown: typeMeta = 1 (runtime.TypeMeta: apiVersion = 1, kind = 2), raw = 2,
    // contentEncoding = 3, contentType = 4.
    let (mut api_version, mut kind, mut raw) = (String::new(), String::new(), None);
    for (n, w) in fields(inner)? {
        match (n, w) {
            (1, Wire::Bytes(tm)) => {
                for (f, v) in fields(tm)? {
                    match (f, v) {
                        (1, Wire::Bytes(b)) => api_version = String::from_utf8_lossy(b).into(),
                        (2, Wire::Bytes(b)) => kind = String::from_utf8_lossy(b).into(),
                        _ => return Err(malformed("TypeMeta")),
                    }
                }
            }
            (2, Wire::Bytes(b)) => raw = Some(b),
            (3 | 4, Wire::Bytes([])) => {}
            (3 | 4, _) => return Err(ProtoError::Unsupported("encoded protobuf content".into())),
            _ => return Err(malformed("runtime.Unknown")),
        }
    }
    let msg = TYPES
        .iter()
        .find(|(av, k, _)| *av == api_version && *k == kind)
        .map(|(.., m)| *m)
        .ok_or_else(|| {
            ProtoError::Unsupported(format!(
                "{api_version} {kind} is not accepted in protobuf by this server"
            ))
        })?;
    let mut obj = decode_message(raw.unwrap_or_default(), msg)?;
    obj["apiVersion"] = json!(api_version);
    obj["kind"] = json!(kind);
    Ok(obj)
}

/// Builds a protobuf message field by field.
#[derive(Debug, Default)]
pub(crate) struct Writer(Vec<u8>);

impl Writer {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, field: u32, wire_type: u8) {
        self.varint((u64::from(field) << 3) | u64::from(wire_type));
    }

    /// A `bytes` or `string` field.
    pub(crate) fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    /// A `string` field.
    pub(crate) fn string(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    /// An embedded message.
    pub(crate) fn message(&mut self, field: u32, m: Writer) {
        self.bytes(field, &m.0);
    }

    /// The encoded message.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(api_version: &str, kind: &str, raw: Writer) -> Vec<u8> {
        let mut tm = Writer::default();
        tm.string(1, api_version);
        tm.string(2, kind);
        let mut u = Writer::default();
        u.message(1, tm);
        u.message(2, raw);
        let mut out = b"k8s\x00".to_vec();
        out.extend(u.into_bytes());
        out
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Bodies kubectl 1.32 sent for `kubectl create namespace|configmap|secret|serviceaccount`.
    #[test]
    fn decodes_what_kubectl_sends() {
        let ns = hex(
            "6b3873000a0f0a02763112094e616d657370616365121e0a160a067465616d2d6112001a0022002a0032003800420012001a020a001a002200",
        );
        assert_eq!(
            decode_object(&ns).unwrap(),
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}, "spec": {}, "status": {}})
        );
        // --from-literal=a=b --from-literal=c=d --from-file=bin=<bytes 00 ff 01 "bin">
        let cm = hex(
            "6b3873000a0f0a0276311209436f6e6669674d617012340a130a0363666712001a0022002a0032003800420012060a016112016212060a01631201641a0d0a0362696e120600ff0162696e1a002200",
        );
        assert_eq!(
            decode_object(&cm).unwrap(),
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                   "data": {"a": "b", "c": "d"}, "binaryData": {"bin": "AP8BYmlu"}})
        );
        // generic --from-literal=user=admin --from-literal=pw=p@ss --type=example.com/custom
        let secret = hex(
            "6b3873000a0c0a027631120653656372657412430a120a02733112001a0022002a00320038004200120a0a027077120470407373120d0a0475736572120561646d696e1a126578616d706c652e636f6d2f637573746f6d1a002200",
        );
        assert_eq!(
            decode_object(&secret).unwrap(),
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s1"},
                   "data": {"pw": "cEBzcw==", "user": "YWRtaW4="}, "type": "example.com/custom"})
        );
        let sa = hex(
            "6b3873000a140a027631120e536572766963654163636f756e7412170a150a05726f626f7412001a0022002a003200380042001a002200",
        );
        assert_eq!(
            decode_object(&sa).unwrap(),
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "robot"}})
        );
    }

    #[test]
    fn pointer_fields_keep_an_explicit_zero() {
        let mut pre = Writer::default();
        pre.string(1, "u-1");
        let mut m = Writer::default();
        m.key(1, 0);
        m.varint(0);
        m.message(2, pre);
        m.string(4, "Foreground");
        m.key(3, 0);
        m.varint(0);
        let d = decode_object(&envelope("meta.k8s.io/v1", "DeleteOptions", m)).unwrap();
        assert_eq!(d["gracePeriodSeconds"], 0);
        assert_eq!(d["orphanDependents"], false);
        assert_eq!(d["preconditions"], json!({"uid": "u-1"}));
        assert_eq!(d["propagationPolicy"], "Foreground");
    }

    #[test]
    fn varints_round_trip() {
        for v in [0u64, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut w = Writer::default();
            w.varint(v);
            let b = w.into_bytes();
            let mut pos = 0;
            assert_eq!(read_varint(&b, &mut pos).unwrap(), v);
            assert_eq!(pos, b.len());
        }
    }

    #[test]
    fn unknown_fields_and_types_are_refused_by_name() {
        let mut m = Writer::default();
        m.string(9, "x");
        let e = decode_object(&envelope("v1", "ConfigMap", m)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "field 9 of k8s.io.api.core.v1.ConfigMap is not supported by this server in protobuf (send JSON instead)"
        );
        let e = decode_object(&envelope("v1", "Pod", Writer::default())).unwrap_err();
        assert!(e.to_string().contains("v1 Pod is not accepted"), "{e}");
        assert!(matches!(
            decode_object(b"{\"kind\":\"x\"}"),
            Err(ProtoError::Malformed(_))
        ));
        assert!(matches!(
            decode_object(b"k8s\x00\x0a\xff"),
            Err(ProtoError::Malformed(_))
        ));
    }
}
