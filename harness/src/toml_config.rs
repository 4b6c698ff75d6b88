//! TOML config machinery shared by `simulate` and `train`: layers deep-merged over an embedded
//! default, `--set key=value` values, errors on one line that name the key, and config values
//! that are one of a fixed set of names ([`named!`](crate::named)), parsed once into a type.

/// Deep merge: tables merge key by key, anything else in `layer` replaces what `base` had.
pub fn merge(base: &mut toml::Table, layer: toml::Table) {
    for (key, value) in layer {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(l)) => merge(b, l),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// A `--set` value: TOML (`4`, `0.5`, `"x"`, `["a", "b"]`), or a bare word that is not valid
/// TOML taken as a string.
pub fn parse_value(raw: &str) -> toml::Value {
    // `toml` parses a value only as part of a document, so wrap it in one.
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_owned())),
        Err(_) => toml::Value::String(raw.to_owned()),
    }
}

/// A table deserialized into `T`, its error on one line. toml names the offending key on a
/// second line (`… expected u32` / ``in `run.steps` ``); a [`named!`](crate::named) value's
/// error (`"fp8" is not one of f32, bf16, f16`) reads after its key instead
/// (`rollout.dtype "fp8" is not one of f32, bf16, f16`).
pub fn from_table<T: serde::de::DeserializeOwned>(t: toml::Table) -> anyhow::Result<T> {
    toml::Value::Table(t)
        .try_into()
        .map_err(|e: toml::de::Error| anyhow::anyhow!("{}", one_line(&e.to_string())))
}

fn one_line(msg: &str) -> String {
    let msg = msg.trim();
    match msg.rsplit_once('\n') {
        Some((what, key)) => {
            let what = what.trim().replace('\n', " ");
            match key
                .trim()
                .strip_prefix("in `")
                .and_then(|k| k.strip_suffix('`'))
            {
                Some(key) if what.starts_with('"') => format!("{key} {what}"),
                _ => format!("{what} {}", key.trim()),
            }
        }
        None => msg.to_owned(),
    }
}

/// The error of a [`named!`](crate::named) value that is none of `names`.
pub fn not_one_of(value: &str, names: &[&str]) -> String {
    format!("{value:?} is not one of {}", names.join(", "))
}

/// Declares a config value that is one of a fixed set of names: an enum that serialises as its
/// name, parses once (its error, [`not_one_of`], lists the names) and prints as its name.
///
/// ```
/// rolloutpipe_harness::named! {
///     /// A colour.
///     pub enum Colour { Red = "red", Green = "green" }
/// }
/// assert_eq!(Colour::Red.name(), "red");
/// let e = toml::from_str::<toml::Table>("c = \"blue\"").unwrap()["c"].clone().try_into::<Colour>();
/// assert!(e.unwrap_err().to_string().contains("\"blue\" is not one of red, green"));
/// ```
#[macro_export]
macro_rules! named {
    ($(#[$m:meta])* $vis:vis enum $T:ident {
        $($(#[$vm:meta])* $V:ident = $name:literal),+ $(,)?
    }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $T {
            $($(#[$vm])* $V),+
        }

        impl $T {
            /// Every value, in declaration order.
            pub const ALL: &'static [$T] = &[$($T::$V),+];
            /// The names, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            /// The name configs use.
            pub fn name(self) -> &'static str {
                match self {
                    $($T::$V => $name),+
                }
            }

            /// The value named `s`; the error lists the names.
            pub fn parse(s: &str) -> ::std::result::Result<Self, String> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name() == s)
                    .ok_or_else(|| $crate::toml_config::not_one_of(s, Self::NAMES))
            }
        }

        impl ::std::fmt::Display for $T {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::serde::Serialize for $T {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> ::std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $T {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> ::std::result::Result<Self, D::Error> {
                let s = <String as ::serde::Deserialize>::deserialize(d)?;
                Self::parse(&s).map_err(<D::Error as ::serde::de::Error>::custom)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::named! {
        /// A test value.
        enum Fruit { Apple = "apple", Pear = "pear" }
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)] // read through Debug only
    struct Doc {
        sec: Sec,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Sec {
        fruit: Fruit,
        n: u32,
    }

    fn err(doc: &str) -> String {
        from_table::<Doc>(toml::from_str(doc).unwrap())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn errors_are_one_line_and_name_the_key() {
        assert_eq!(
            err("[sec]\nfruit = \"plum\"\nn = 1\n"),
            "sec.fruit \"plum\" is not one of apple, pear"
        );
        let e = err("[sec]\nfruit = \"pear\"\nn = -3\n");
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains("sec.n"), "{e}");
        assert_eq!(Fruit::parse("pear"), Ok(Fruit::Pear));
        assert_eq!(Fruit::Apple.to_string(), "apple");
    }

    #[test]
    fn layers_merge_deeply_and_bare_words_are_strings() {
        let mut base: toml::Table = toml::from_str("[a]\nx = 1\ny = 2\n").unwrap();
        merge(
            &mut base,
            toml::from_str("[a]\ny = 3\n[b]\nz = 4\n").unwrap(),
        );
        assert_eq!(base["a"]["x"].as_integer(), Some(1));
        assert_eq!(base["a"]["y"].as_integer(), Some(3));
        assert_eq!(base["b"]["z"].as_integer(), Some(4));
        assert_eq!(parse_value("sync"), toml::Value::String("sync".into()));
        assert_eq!(parse_value("0.5"), toml::Value::Float(0.5));
        assert_eq!(parse_value("\"x y\""), toml::Value::String("x y".into()));
    }
}
