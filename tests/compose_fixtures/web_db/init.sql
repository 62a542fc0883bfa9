CREATE TABLE items (id int);
